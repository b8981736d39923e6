"""What the streaming decoder and encoder share: the ``AutoencoderKLWan`` internals they rely on (checked), the tile
blending of ``tiled_decode``/``tiled_encode``, and the per-lane, per-tile caches of the causal convolutions (see the
package docstring)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders import autoencoder_kl_wan
from diffusers.utils.torch_utils import get_module_execution_device

_VAE_ATTRIBUTES = (
    "encoder", "decoder", "quant_conv", "post_quant_conv", "blend_v", "blend_h", "use_slicing", "use_tiling",
    "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height", "tile_sample_stride_width",
    "spatial_compression_ratio", "_decode", "_encode", "tiled_decode", "tiled_encode", "clear_cache",
)
_CONFIG_KEYS = ("z_dim", "latents_mean", "latents_std", "in_channels", "out_channels", "patch_size")
_MODULE_NAMES = ("WanCausalConv3d", "patchify", "unpatchify")
_FORWARD_PARAMETERS = {"encoder": ("feat_cache", "feat_idx"), "decoder": ("feat_cache", "feat_idx", "first_chunk")}
_SLICING = "batch slicing (vae.use_slicing with batch > 1)"  # a setting of the stream, named as its error names it


def _missing_internals(vae) -> list[str]:
    """The ``AutoencoderKLWan`` internals of the module docstring that ``vae`` or the installed diffusers lacks."""
    missing = [f"vae.{name}" for name in _VAE_ATTRIBUTES if not hasattr(vae, name)]
    missing += [f"vae.config.{key}" for key in _CONFIG_KEYS if key not in vae.config]
    missing += [f"{autoencoder_kl_wan.__name__}.{name}" for name in _MODULE_NAMES
                if not hasattr(autoencoder_kl_wan, name)]
    for module, parameters in _FORWARD_PARAMETERS.items():
        if hasattr(vae, module):
            accepted = inspect.signature(getattr(vae, module).forward).parameters
            missing += [f"vae.{module}.forward({name}=...)" for name in parameters if name not in accepted]
    return missing


def _video_channels(vae, channels: int) -> int:
    """The channels of the video: the VAE's ``in_channels``/``out_channels`` count patchified channels."""
    patch_size = vae.config.patch_size
    return channels if patch_size is None else channels // (patch_size * patch_size)


def _blend_tiles(vae, rows: list[list[torch.Tensor]], blend_height: int, blend_width: int, keep_height: int,
                 keep_width: int) -> torch.Tensor:
    """Blend a grid of decoded (encoded) tiles into one tensor, as ``tiled_decode``/``tiled_encode`` do: in raster
    order, each tile blended in place with the (already blended) tiles above and to its left. Per frame."""
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, blend_height)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend_width)
            result_row.append(tile[:, :, :, :keep_height, :keep_width])
        result_rows.append(torch.cat(result_row, dim=-1))
    return torch.cat(result_rows, dim=3)


class _CausalVAEStream:
    """What the decoder and encoder share: the VAE checks, the stream's settings, the per-lane, per-tile caches."""

    _side = ""  # "decoder" or "encoder": the VAE module whose causal convolutions are cached

    def __init__(self, vae):
        if not isinstance(vae, AutoencoderKLWan):
            raise TypeError(f"{type(self).__name__} wraps a diffusers AutoencoderKLWan (pipe.vae of a Wan pipeline), "
                            f"got {type(vae).__name__}")
        missing = _missing_internals(vae)
        if missing:
            raise RuntimeError(
                f"{type(self).__name__} relies on AutoencoderKLWan internals that this diffusers release lacks: "
                f"{', '.join(missing)}; install the diffusers version diffusers_causal_kv supports "
                f"(pip install 'diffusers>=0.42.1,<0.43') or decode/encode in one go with vae.decode/vae.encode")
        self.vae = vae
        self._slots = sum(isinstance(m, autoencoder_kl_wan.WanCausalConv3d)
                          for m in getattr(vae, self._side).modules())
        self.reset()

    def reset(self) -> None:
        """Forget the stream: the next call starts a new video (and may change batch, size and VAE settings)."""
        self._settings = None
        self._caches = {}  # (lane, tile row, tile column) -> the feature cache list of that lane and tile
        self._latent_frames = 0

    @contextlib.contextmanager
    def _step(self):
        """One decode / encode call, all or nothing: a call that raises leaves the stream as it was, so it can be made
        again (the VAE replaces cache slots with new tensors and never writes into a cached one)."""
        saved = self.__dict__.copy(), {key: list(cache) for key, cache in self._caches.items()}
        try:
            yield
        except BaseException:
            self.__dict__.update(saved[0])
            self._caches = saved[1]
            raise

    @property
    def latent_frames(self) -> int:
        """Latent frames decoded (encoded) since the stream started."""
        return self._latent_frames

    def memory_bytes(self) -> int:
        """Bytes of the tensors the stream holds between calls (feature caches, pending frames)."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors())

    def _state_tensors(self) -> Iterator[torch.Tensor]:
        for cache in self._caches.values():
            yield from (slot for slot in cache if isinstance(slot, torch.Tensor))

    def _cache(self, lane: int, row: int, column: int) -> list:
        return self._caches.setdefault((lane, row, column), [None] * self._slots)

    def _check_settings(self, x: torch.Tensor, tiled: bool) -> None:
        """Refuse a call that does not continue the stream's first call (before anything is computed)."""
        vae = self.vae
        settings = {
            "batch": x.shape[0],
            "frame size": tuple(x.shape[-2:]),
            "vae dtype": vae.dtype,
            "execution device": get_module_execution_device(vae),
            _SLICING: vae.use_slicing and x.shape[0] > 1,
            "spatial tiling (vae.use_tiling and frames larger than a tile)": tiled and (
                vae.tile_sample_min_height, vae.tile_sample_min_width,
                vae.tile_sample_stride_height, vae.tile_sample_stride_width),
        }
        if self._settings is None:
            self._settings = settings
            return
        for name, value in settings.items():
            if value != self._settings[name]:
                raise ValueError(
                    f"{type(self).__name__}: {name} is {value} but this stream started with {self._settings[name]}; "
                    f"keep it for the whole video, or call reset() to start a new one")

    def _lanes(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The batch as ``decode``/``encode`` process it: one sample at a time when slicing, else whole."""
        return list(x.split(1)) if self._settings[_SLICING] else [x]

    def _onload(self) -> None:
        """What ``apply_forward_hook`` does before ``vae.decode``/``vae.encode``: onload a CPU-offloaded VAE."""
        hook = getattr(self.vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(self.vae)


