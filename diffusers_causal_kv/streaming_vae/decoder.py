"""Chunk-by-chunk decoding equal to one ``vae.decode`` (see the package docstring)."""

from __future__ import annotations

import torch
from diffusers.models.autoencoders import autoencoder_kl_wan
from diffusers.utils.torch_utils import get_module_execution_device

from .core import _blend_tiles, _CausalVAEStream, _video_channels


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
        with self._step():  # all or nothing: a call that raises can be made again
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


