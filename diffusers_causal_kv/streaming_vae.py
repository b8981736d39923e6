"""Streaming Wan VAE: decode each chunk's latents as soon as it is produced, encode video frames as they arrive.

``StreamingVAEDecoder(vae).decode(latents)``
    Takes the pipeline's normalised latents ``[batch, z_dim, frames, h, w]`` (any number of latent frames per call,
    one included), un-normalises them exactly as the stock ``WanPipeline`` does before ``vae.decode`` and returns
    the chunk's video frames ``[batch, 3, video_frames, h * s, w * s]`` (``s`` the VAE's
    ``spatial_compression_ratio``, 8 or 16; clamped to ``[-1, 1]``, in the VAE's dtype), as ``vae.decode(...).sample``
    gives them. The first latent frame of a stream gives 1 video frame, every later one 4. The frames of all the
    calls, concatenated along time, equal one ``vae.decode`` of all the latents bit for bit (see "Bit equality").
``StreamingVAEEncoder(vae).encode(frames, sample_mode="argmax", generator=None)``
    Takes video frames ``[batch, 3, frames, H, W]`` in ``[-1, 1]`` (what ``VideoProcessor.preprocess_video`` gives),
    in any counts: the first video frame of a stream makes latent frame 0, every 4 further frames one more
    latent frame; the remainder is buffered (:attr:`~StreamingVAEEncoder.pending_frames`) until the next call, so a
    call returns 0 or more latent frames (an empty tensor with 0 frames when none completed). It returns the
    normalised latents the Wan pipelines feed the transformer: ``sample_mode="argmax"`` (the pipelines' choice) the
    latent distribution's mean, ``"sample"`` a draw from it with ``generator``; then ``(latents - latents_mean) /
    latents_std``, computed in fp32 and cast to the VAE's dtype, as ``WanVACEPipeline.prepare_video_latents`` does.
    With ``"argmax"`` the latents of all the calls equal ``vae.encode(video).latent_dist.mode()`` (normalised the
    same way) bit for bit; a one-shot encode drops the frames after the last complete group of 4, which the stream
    keeps pending. ``"sample"`` draws its noise per call, so it matches one-shot sampling in distribution only.
    :meth:`~StreamingVAEEncoder.encode_iter` wraps ``encode`` over an iterable of frame tensors and yields the
    latent frames one at a time as they complete.

Both are inference only (they run under ``torch.no_grad()``) and take the stock ``AutoencoderKLWan`` as it is, its
settings included: batch slicing (``vae.enable_slicing()``: one cache per sample, as ``decode``/``encode`` slice the
batch) and spatial tiling (``vae.enable_tiling()``: one cache per tile, the tiles blended per frame exactly as
``tiled_decode``/``tiled_encode`` blend them, which is causal). A stream reads the batch, the frame size, the VAE's
dtype and device, slicing and tiling at its first call and keeps them; changing one of them mid-stream is refused
(``reset()`` starts a new video). ``reset()`` forgets the stream; the VAE itself is never modified. An error raised
inside the VAE's modules (out of memory, say) leaves the stream part-way through a chunk: ``reset()`` and start over.

Bit equality
    The decoder (encoder) runs on one latent frame (group of video frames) at a time, as in the stock loop, so each
    step runs the same kernels on the same shapes with the same cached frames. The one step that sees the chunk
    instead of the whole video is the pointwise (1x1x1) ``post_quant_conv`` (``quant_conv``) of the plain path: torch
    picks its convolution kernel by input size, and its CPU kernels were measured to give the same bits over a chunk
    as over the whole video once a latent frame has 16 positions or more (``h * w >= 16``; every real Wan size, e.g.
    60x104), but not for tiny frames (2x2 latents differ in the last bit). GPU kernels were not measured. The tiled
    paths apply these convolutions per frame and tile in the stock code too, so they match at any size.

State and memory
    Every causal 3D convolution of the VAE reads the last frames of its input from the previous call: the decoder
    (encoder) keeps one such feature cache per lane (the batch, or each sample when slicing) and tile, a list with
    one slot per ``WanCausalConv3d`` holding at most 2 frames of that convolution's input. So
    :meth:`memory_bytes` stops growing after the first chunks, however long the stream (the encoder adds at most 3
    pending video frames). The VAE's own caches (``vae._feat_map``, ``vae._enc_feat_map``) are never touched, so a
    plain ``vae.decode``/``vae.encode`` may run between (or during) the calls of a stream.

AutoencoderKLWan internals relied on (diffusers 0.42; :func:`_missing_internals` checks them when a stream is built
and ``tests/test_streaming_vae.py`` checks them and the bit equality against every path of the installed release)
    * the frame loops of ``AutoencoderKLWan._decode`` and ``_encode``, replicated: ``post_quant_conv`` over the
      latents, then ``decoder(x[:, :, i:i + 1], feat_cache=..., feat_idx=[0], first_chunk=(i == 0))`` per latent
      frame; ``encoder(group, feat_cache=..., feat_idx=[0])`` on frame 0, then on each group of 4 frames, then
      ``quant_conv``; ``patchify``/``unpatchify`` (functions of ``diffusers.models.autoencoders.autoencoder_kl_wan``)
      when ``config.patch_size`` is set, and the final ``torch.clamp(-1, 1)`` of the decoder;
    * ``tiled_decode`` and ``tiled_encode``, replicated per chunk: the tile geometry from ``tile_sample_min_height``,
      ``tile_sample_min_width``, ``tile_sample_stride_height``, ``tile_sample_stride_width`` and
      ``spatial_compression_ratio``, and the blending with ``vae.blend_v``/``vae.blend_h``; the choice between the
      tiled and plain paths as ``_decode``/``_encode`` make it (``use_tiling`` and the frame size); ``use_slicing``;
    * the feature-cache protocol of the causal convolutions: a list with one slot (initially ``None``) per
      ``WanCausalConv3d`` module of the encoder or decoder (as ``clear_cache`` sizes ``_feat_map`` and
      ``_enc_feat_map``), written in place by the modules;
    * ``config.z_dim``, ``config.latents_mean``, ``config.latents_std``, ``config.in_channels``,
      ``config.out_channels``, ``config.patch_size``; ``DiagonalGaussianDistribution`` (``mode``, ``sample``); the
      ``_hf_hook.pre_forward`` call of ``apply_forward_hook`` (model CPU offloading) and
      ``diffusers.utils.torch_utils.get_module_execution_device``, as ``decode``/``encode`` and the pipelines use them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders import autoencoder_kl_wan
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.utils.torch_utils import get_module_execution_device

__all__ = ["StreamingVAEDecoder", "StreamingVAEEncoder"]

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


class StreamingVAEDecoder(_CausalVAEStream):
    """Decodes a causal rollout's latents chunk by chunk, keeping the decoder's causal feature cache between chunks,
    so that the frames of all chunks equal one ``vae.decode`` of all the latents bit for bit (see the module
    docstring). ``decode(latents)`` per chunk, ``reset()`` before a new video."""

    _side = "decoder"

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next latent frames of the stream.

        Args:
            latents: the pipeline's normalised latents ``[batch, z_dim, frames, h, w]``, any number of frames.

        Returns:
            The video frames of these latents ``[batch, 3, video_frames, h * s, w * s]`` (``s`` the VAE's
            ``spatial_compression_ratio``), in ``[-1, 1]``, in the VAE's dtype, as ``vae.decode(...).sample`` gives
            them: 1 + 4 * (frames - 1) video frames on the stream's first call, 4 * frames after.
        """
        vae = self.vae
        z_dim = vae.config.z_dim
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5 or latents.shape[1] != z_dim:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(
                f"StreamingVAEDecoder.decode() takes the pipeline's normalised latents [batch, {z_dim}, frames, "
                f"height, width], got {got}; pass the transformer's latents (the rollout's output) as they are")
        height, width = latents.shape[-2:]
        ratio = vae.spatial_compression_ratio
        tiled = vae.use_tiling and (width > vae.tile_sample_min_width // ratio
                                    or height > vae.tile_sample_min_height // ratio)
        self._check_settings(latents, tiled)
        if latents.shape[2] == 0:
            return latents.new_empty(latents.shape[0], _video_channels(vae, vae.config.out_channels), 0,
                                     height * ratio, width * ratio, dtype=vae.dtype)
        self._onload()
        z = self._unnormalise(latents)
        decode = self._decode_tiled if tiled else self._decode_plain
        video = torch.cat([decode(lane_z, lane) for lane, lane_z in enumerate(self._lanes(z))])
        self._latent_frames += latents.shape[2]
        return video

    def _unnormalise(self, latents: torch.Tensor) -> torch.Tensor:
        """Exactly the stock ``WanPipeline`` before ``vae.decode``: ``latents / (1 / std) + mean`` in the VAE dtype."""
        vae = self.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
        latents_mean = (
            torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        )
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        return latents / latents_std + latents_mean

    def _first_chunk(self, frame: int) -> bool:
        return self._latent_frames == 0 and frame == 0

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        patch_size = self.vae.config.patch_size
        if patch_size is not None:
            out = autoencoder_kl_wan.unpatchify(out, patch_size=patch_size)
        return torch.clamp(out, min=-1.0, max=1.0)

    def _decode_plain(self, z: torch.Tensor, lane: int) -> torch.Tensor:
        """``AutoencoderKLWan._decode``'s loop over this chunk's frames."""
        vae, cache = self.vae, self._cache(lane, 0, 0)
        x = vae.post_quant_conv(z)
        frames = [vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=self._first_chunk(i))
                  for i in range(z.shape[2])]
        return self._finish(torch.cat(frames, 2))

    def _decode_tiled(self, z: torch.Tensor, lane: int) -> torch.Tensor:
        """``AutoencoderKLWan.tiled_decode`` over this chunk's frames, one feature cache per tile."""
        vae = self.vae
        _, _, num_frames, height, width = z.shape
        ratio, patch_size = vae.spatial_compression_ratio, vae.config.patch_size
        sample_height, sample_width = height * ratio, width * ratio
        tile_latent_min_height = vae.tile_sample_min_height // ratio
        tile_latent_min_width = vae.tile_sample_min_width // ratio
        tile_latent_stride_height = vae.tile_sample_stride_height // ratio
        tile_latent_stride_width = vae.tile_sample_stride_width // ratio
        tile_sample_stride_height = vae.tile_sample_stride_height
        tile_sample_stride_width = vae.tile_sample_stride_width
        if patch_size is not None:
            sample_height, sample_width = sample_height // patch_size, sample_width // patch_size
            tile_sample_stride_height = tile_sample_stride_height // patch_size
            tile_sample_stride_width = tile_sample_stride_width // patch_size
            blend_height = vae.tile_sample_min_height // patch_size - tile_sample_stride_height
            blend_width = vae.tile_sample_min_width // patch_size - tile_sample_stride_width
        else:
            blend_height = vae.tile_sample_min_height - tile_sample_stride_height
            blend_width = vae.tile_sample_min_width - tile_sample_stride_width

        rows = []
        for i in range(0, height, tile_latent_stride_height):
            row = []
            for j in range(0, width, tile_latent_stride_width):
                cache = self._cache(lane, i, j)
                frames = []
                for k in range(num_frames):
                    tile = vae.post_quant_conv(z[:, :, k : k + 1, i : i + tile_latent_min_height,
                                                 j : j + tile_latent_min_width])
                    frames.append(vae.decoder(tile, feat_cache=cache, feat_idx=[0], first_chunk=self._first_chunk(k)))
                row.append(torch.cat(frames, dim=2))
            rows.append(row)
        out = _blend_tiles(vae, rows, blend_height, blend_width, tile_sample_stride_height, tile_sample_stride_width)
        return self._finish(out[:, :, :, :sample_height, :sample_width])


class StreamingVAEEncoder(_CausalVAEStream):
    """Encodes video frames as they arrive, keeping the encoder's causal feature cache between calls and buffering
    the frames of an incomplete group of 4, so that the latents of all calls equal one ``vae.encode`` bit for bit
    (``sample_mode="argmax"``; see the module docstring). ``encode(frames)`` per call, ``encode_iter(frames)`` over
    an iterable, ``reset()`` before a new video."""

    _side = "encoder"

    def reset(self) -> None:
        super().reset()
        self._pending = None  # video frames of the next, incomplete group, already in the VAE's dtype and device

    @property
    def pending_frames(self) -> int:
        """Video frames received but not encoded yet (waiting for their group of 4 to complete)."""
        return 0 if self._pending is None else self._pending.shape[2]

    def _state_tensors(self) -> Iterator[torch.Tensor]:
        yield from super()._state_tensors()
        if self._pending is not None:
            yield self._pending

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, sample_mode: str = "argmax",
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Encode the next video frames of the stream.

        Args:
            frames: ``[batch, 3, frames, H, W]`` in ``[-1, 1]``, any number of frames.
            sample_mode: ``"argmax"`` (the latent distribution's mean, as the Wan pipelines encode conditions) or
                ``"sample"`` (a draw from it).
            generator: the generator of ``"sample"``.

        Returns:
            The normalised latents of the latent frames completed by this call, ``[batch, z_dim, n, H / s, W / s]``
            (``s`` the VAE's ``spatial_compression_ratio``) in the VAE's dtype; ``n`` may be 0.
        """
        vae = self.vae
        channels = _video_channels(vae, vae.config.in_channels)
        if not isinstance(frames, torch.Tensor) or frames.ndim != 5 or frames.shape[1] != channels:
            got = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(
                f"StreamingVAEEncoder.encode() takes video frames [batch, {channels}, frames, height, width] in "
                f"[-1, 1], got {got}; pass VideoProcessor.preprocess_video(...) output, channels first")
        if sample_mode not in ("argmax", "sample"):
            raise ValueError(f"sample_mode must be 'argmax' or 'sample', got {sample_mode!r}")
        height, width = frames.shape[-2:]
        tiled = vae.use_tiling and (width > vae.tile_sample_min_width or height > vae.tile_sample_min_height)
        self._check_settings(frames, tiled)

        frames = frames.to(get_module_execution_device(vae), dtype=vae.dtype)
        if self._pending is not None:
            frames = torch.cat([self._pending, frames], dim=2)
        groups, start = [], 0
        if self._latent_frames == 0 and frames.shape[2] > 0:
            groups, start = [(0, 1)], 1
        while frames.shape[2] - start >= 4:
            groups.append((start, start + 4))
            start += 4
        # a copy, so that the stream keeps at most 3 frames, never the caller's whole tensor
        self._pending = frames[:, :, start:].clone() if start < frames.shape[2] else None
        ratio = vae.spatial_compression_ratio
        if not groups:
            return frames.new_empty(frames.shape[0], vae.config.z_dim, 0, height // ratio, width // ratio)

        self._onload()
        x = frames[:, :, :start]
        if vae.config.patch_size is not None:
            x = autoencoder_kl_wan.patchify(x, patch_size=vae.config.patch_size)
        encode = self._encode_tiled if tiled else self._encode_plain
        moments = torch.cat([encode(lane_x, lane, groups) for lane, lane_x in enumerate(self._lanes(x))])
        self._latent_frames += len(groups)
        posterior = DiagonalGaussianDistribution(moments)
        latents = posterior.mode() if sample_mode == "argmax" else posterior.sample(generator)
        return self._normalise(latents)

    def encode_iter(self, frames: Iterable[torch.Tensor], sample_mode: str = "argmax",
                    generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """:meth:`encode` each tensor of ``frames`` (video frames in any counts) in turn and yield the latent frames
        as they complete, one at a time (``[batch, z_dim, 1, h, w]``). Frames still pending at the end stay pending."""
        for chunk in frames:
            latents = self.encode(chunk, sample_mode, generator)
            for frame in range(latents.shape[2]):  # not split(): it gives one empty piece of an empty tensor
                yield latents[:, :, frame : frame + 1]

    def _normalise(self, latents: torch.Tensor) -> torch.Tensor:
        """``WanVACEPipeline.prepare_video_latents``: ``(latents - mean) * (1 / std)`` in fp32, to the VAE dtype."""
        vae, device = self.vae, latents.device
        latents_mean = torch.tensor(vae.config.latents_mean, device=device, dtype=torch.float32).view(
            1, vae.config.z_dim, 1, 1, 1)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std, device=device, dtype=torch.float32).view(
            1, vae.config.z_dim, 1, 1, 1)
        return ((latents.float() - latents_mean) * latents_std).to(vae.dtype)

    def _encode_plain(self, x: torch.Tensor, lane: int, groups: list[tuple[int, int]]) -> torch.Tensor:
        """``AutoencoderKLWan._encode``'s loop over this call's groups of frames."""
        vae, cache = self.vae, self._cache(lane, 0, 0)
        out = torch.cat([vae.encoder(x[:, :, a:b], feat_cache=cache, feat_idx=[0]) for a, b in groups], 2)
        return vae.quant_conv(out)

    def _encode_tiled(self, x: torch.Tensor, lane: int, groups: list[tuple[int, int]]) -> torch.Tensor:
        """``AutoencoderKLWan.tiled_encode`` over this call's groups of frames, one feature cache per tile."""
        vae = self.vae
        _, _, _, height, width = x.shape
        ratio = vae.spatial_compression_ratio
        if vae.config.patch_size is not None:
            ratio = ratio // vae.config.patch_size
        latent_height, latent_width = height // ratio, width // ratio
        tile_latent_min_height = vae.tile_sample_min_height // ratio
        tile_latent_min_width = vae.tile_sample_min_width // ratio
        tile_latent_stride_height = vae.tile_sample_stride_height // ratio
        tile_latent_stride_width = vae.tile_sample_stride_width // ratio
        blend_height = tile_latent_min_height - tile_latent_stride_height
        blend_width = tile_latent_min_width - tile_latent_stride_width

        rows = []
        for i in range(0, height, vae.tile_sample_stride_height):
            row = []
            for j in range(0, width, vae.tile_sample_stride_width):
                cache = self._cache(lane, i, j)
                latents = []
                for a, b in groups:
                    tile = x[:, :, a:b, i : i + vae.tile_sample_min_height, j : j + vae.tile_sample_min_width]
                    tile = vae.encoder(tile, feat_cache=cache, feat_idx=[0])
                    latents.append(vae.quant_conv(tile))
                row.append(torch.cat(latents, dim=2))
            rows.append(row)
        out = _blend_tiles(vae, rows, blend_height, blend_width, tile_latent_stride_height, tile_latent_stride_width)
        return out[:, :, :, :latent_height, :latent_width]
