"""Chunk-by-chunk encoding equal to one ``vae.encode`` (see the package docstring)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from diffusers.models.autoencoders import autoencoder_kl_wan
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.utils.torch_utils import get_module_execution_device

from .core import _blend_tiles, _CausalVAEStream, _video_channels


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
        with self._step():  # all or nothing: a call that raises can be made again
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
