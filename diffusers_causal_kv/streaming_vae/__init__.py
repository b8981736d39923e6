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

from .decoder import StreamingVAEDecoder
from .encoder import StreamingVAEEncoder

__all__ = ["StreamingVAEDecoder", "StreamingVAEEncoder"]
