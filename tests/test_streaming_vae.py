"""Streaming VAE decode and encode (``diffusers_causal_kv.streaming_vae``): the frames (latents) of a stream, whatever
its chunking, equal one stock ``vae.decode`` (``vae.encode``) of the whole video bit for bit, on every path of the
stock VAE (plain, batch slicing, spatial tiling, the Wan2.2 patchified VAE); the stream's state stays bounded; the
``AutoencoderKLWan`` internals the module drives are still those of the installed diffusers.

The references are the stock code: ``vae.decode`` after the un-normalisation of ``WanPipeline.__call__``, and
``vae.encode(...).latent_dist.mode()`` normalised as ``WanVACEPipeline.prepare_video_latents`` does. Latent frames
are 4x4 (16 positions): torch picks its CPU convolution kernel by size, and below 16 positions per frame the 1x1x1
``post_quant_conv`` may round differently over a chunk than over the whole video (see the module docstring).
"""

from __future__ import annotations

import itertools

import diffusers
import pytest
import torch
from diffusers import AutoencoderKLWan

from diffusers_causal_kv.streaming_vae import StreamingVAEDecoder, StreamingVAEEncoder
from diffusers_causal_kv.streaming_vae.core import _missing_internals
from diffusers_causal_kv.testing import tiny_vae

Z_DIM = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny VAE's convolutions are a few channels wide: one intra-op thread runs them several times faster than
    two on a busy machine (the threads wait for each other after every small kernel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vae():
    return tiny_vae(seed=0).eval()


def _wan22_vae():
    """A tiny Wan2.2-style VAE: residual up/down blocks (``DupUp3D`` with ``first_chunk``), patch size 2, 16x."""
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=4, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True,
        in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0]).eval()


def _latents(batch=2, frames=7, h=4, w=4, z_dim=Z_DIM, seed=0):
    return torch.randn(batch, z_dim, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _video(batch=2, frames=13, height=32, width=32, seed=1):
    return torch.rand(batch, 3, frames, height, width, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def stock_decode(vae, latents):
    """``WanPipeline.__call__`` after the denoising loop (diffusers pipelines/wan/pipeline_wan.py), verbatim."""
    latents = latents.to(vae.device, dtype=vae.dtype)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype)
    latents = latents / latents_std + latents_mean
    return vae.decode(latents, return_dict=False)[0]


@torch.no_grad()
def stock_encode(vae, video):
    """``WanVACEPipeline.prepare_video_latents`` (``sample_mode="argmax"``), for one video tensor."""
    latents_mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, vae.config.z_dim, 1, 1, 1)
    latents = vae.encode(video.to(vae.dtype)).latent_dist.mode()
    return ((latents.float() - latents_mean) * latents_std).to(vae.dtype)


def stream_decode(decoder, latents, sizes):
    chunks, start = [], 0
    for size in sizes:
        chunks.append(decoder.decode(latents[:, :, start : start + size]))
        start += size
    return chunks


def stream_encode(encoder, video, sizes):
    chunks, start = [], 0
    for size in sizes:
        chunks.append(encoder.encode(video[:, :, start : start + size]))
        start += size
    return chunks


# ---------------------------------------------------------------------------------------------- decode
@pytest.fixture(scope="module")
def decoded(vae):
    """Six latent frames of batch 2 and their one-shot stock decode."""
    latents = _latents(frames=6)
    return latents, stock_decode(vae, latents)


@pytest.mark.parametrize("sizes", [[1] * 6, [1, 2, 3], [3, 3], [2, 4], [6], [1, 3, 0, 2]],
                         ids=lambda sizes: "-".join(map(str, sizes)))
def test_streamed_decode_equals_one_shot_decode(vae, decoded, sizes):
    latents, expected = decoded
    chunks = stream_decode(StreamingVAEDecoder(vae), latents, sizes)
    # the first latent frame gives 1 video frame, every later one 4
    assert [c.shape[2] for c in chunks] == [4 * n - 3 * (i == 0 and n > 0) for i, n in enumerate(sizes)]
    assert torch.equal(torch.cat(chunks, dim=2), expected)


def test_reset_starts_a_new_video(vae):
    decoder = StreamingVAEDecoder(vae)
    first, second = _latents(seed=0), _latents(batch=1, frames=3, h=4, w=8, seed=1)
    stream_decode(decoder, first, [2, 3])
    assert decoder.latent_frames == 5
    decoder.reset()
    assert decoder.latent_frames == 0 and decoder.memory_bytes() == 0
    assert torch.equal(torch.cat(stream_decode(decoder, second, [1, 2]), 2), stock_decode(vae, second))


def test_a_stream_is_independent_of_vae_decode_calls_between_its_chunks(vae, decoded):
    latents, expected = decoded
    decoder = StreamingVAEDecoder(vae)
    chunks = [decoder.decode(latents[:, :, :3])]
    stock_decode(vae, _latents(batch=1, frames=2, seed=2))  # the VAE's own caches are set up and cleared in between
    chunks.append(decoder.decode(latents[:, :, 3:]))
    assert torch.equal(torch.cat(chunks, 2), expected)


def test_batch_slicing_decodes_and_encodes_per_sample_as_the_stock_vae(vae):
    latents, video = _latents(frames=4), _video(frames=9)
    vae.enable_slicing()
    try:
        decoded = torch.cat(stream_decode(StreamingVAEDecoder(vae), latents, [1, 3]), 2)
        encoded = torch.cat(stream_encode(StreamingVAEEncoder(vae), video, [2, 7]), 2)
        assert torch.equal(decoded, stock_decode(vae, latents))
        assert torch.equal(encoded, stock_encode(vae, video))
    finally:
        vae.disable_slicing()


def test_spatial_tiling_matches_tiled_decode_and_tiled_encode(vae):
    latents, video = _latents(batch=1, frames=4), _video(batch=1, frames=9)
    # 24-pixel tiles every 16 pixels: a 2x2 grid of tiles over these 32x32 frames, blended on both axes
    vae.enable_tiling(tile_sample_min_height=24, tile_sample_min_width=24, tile_sample_stride_height=16,
                      tile_sample_stride_width=16)
    try:
        decoder, encoder = StreamingVAEDecoder(vae), StreamingVAEEncoder(vae)
        decoded = torch.cat(stream_decode(decoder, latents, [1, 2, 1]), 2)
        encoded = torch.cat(stream_encode(encoder, video, [1, 3, 5]), 2)
        assert len(decoder._caches) == 4 and len(encoder._caches) == 4  # one feature cache per tile
        assert torch.equal(decoded, stock_decode(vae, latents))
        assert torch.equal(encoded, stock_encode(vae, video))
    finally:
        vae.disable_tiling()


def test_wan22_patchified_vae():
    vae = _wan22_vae()
    latents = _latents(frames=5, z_dim=4)
    video = _video(frames=9, height=64, width=64)
    decoded = torch.cat(stream_decode(StreamingVAEDecoder(vae), latents, [1, 2, 2]), 2)
    encoded = torch.cat(stream_encode(StreamingVAEEncoder(vae), video, [2, 1, 6]), 2)
    assert decoded.shape == (2, 3, 17, 64, 64) and encoded.shape == (2, 4, 3, 4, 4)
    assert torch.equal(decoded, stock_decode(vae, latents))
    assert torch.equal(encoded, stock_encode(vae, video))


# ---------------------------------------------------------------------------------------------- encode
@pytest.fixture(scope="module")
def encoded(vae):
    """15 video frames of batch 2 (1 + 4 * 3 make 4 latent frames; one-shot encode drops the last 2) and their
    one-shot stock encode."""
    video = _video(frames=15)
    return video, stock_encode(vae, video)


@pytest.mark.parametrize("sizes", [[1] * 15, [1, 4, 4, 4, 2], [3, 5, 7], [15], [2, 7, 0, 6], [4, 4, 4, 3]],
                         ids=lambda sizes: "-".join(map(str, sizes)))
def test_streamed_encode_equals_one_shot_encode(vae, encoded, sizes):
    video, expected = encoded
    encoder = StreamingVAEEncoder(vae)
    chunks = stream_encode(encoder, video, sizes)
    arrived = list(itertools.accumulate(sizes))
    assert [c.shape[2] for c in chunks] == [min(4, (n + 3) // 4) - min(4, (a + 3) // 4)
                                            for a, n in zip([0] + arrived, arrived)]
    assert all(c.shape[0] == 2 and c.shape[1] == Z_DIM and c.shape[3:] == (4, 4) for c in chunks)
    assert encoder.pending_frames == 2 and encoder.latent_frames == 4
    assert torch.equal(torch.cat(chunks, dim=2), expected)


def test_encode_iter_yields_each_latent_frame_as_soon_as_its_frames_arrived(vae, encoded):
    video, expected = encoded
    arrived = []

    def one_at_a_time():
        for i in range(video.shape[2]):
            arrived.append(i + 1)
            yield video[:, :, i : i + 1]

    encoder = StreamingVAEEncoder(vae)
    latents, seen = [], []
    for latent in encoder.encode_iter(one_at_a_time()):
        latents.append(latent)
        seen.append(arrived[-1])
    assert seen == [1, 5, 9, 13] and encoder.pending_frames == 2
    assert all(latent.shape[2] == 1 for latent in latents)
    assert torch.equal(torch.cat(latents, 2), expected)


def test_sample_mode_draws_from_the_latent_distribution(vae):
    video = _video(frames=1)
    latents = StreamingVAEEncoder(vae).encode(video, sample_mode="sample",
                                              generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        drawn = vae.encode(video).latent_dist.sample(torch.Generator().manual_seed(3))
    mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1)
    assert torch.equal(latents, (drawn - mean) * (1.0 / torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1)))
    assert not torch.equal(latents, StreamingVAEEncoder(vae).encode(video))


# ---------------------------------------------------------------------------------------------- memory
def test_memory_stays_flat_over_an_unbounded_stream(vae):
    decoder, encoder = StreamingVAEDecoder(vae), StreamingVAEEncoder(vae)
    latents = _latents(batch=1, frames=100, h=2, w=2)
    video = _video(batch=1, frames=150, height=16, width=16)
    decoder_bytes, encoder_bytes, start = [], [], 0
    for _, size in zip(range(50), itertools.cycle([1, 2, 3])):  # 50 chunks, 99 latent frames
        decoder.decode(latents[:, :, start : start + size])
        decoder_bytes.append(decoder.memory_bytes())
        start += size
    for i in range(50):  # 150 frames in threes: groups of 4 complete at every phase, up to 3 frames pending
        encoder.encode(video[:, :, 3 * i : 3 * i + 3])
        encoder_bytes.append(encoder.memory_bytes())
    assert decoder.latent_frames == 99 and encoder.latent_frames == 38
    assert len(set(decoder_bytes[2:])) == 1, decoder_bytes  # 2 frames per causal convolution, from chunk 2 on
    assert max(encoder_bytes[8:]) <= max(encoder_bytes[:8]), encoder_bytes


# ---------------------------------------------------------------------------------------------- misuse
def test_a_stream_keeps_its_batch_size_and_settings(vae):
    decoder = StreamingVAEDecoder(vae)
    decoder.decode(_latents(frames=1))
    with pytest.raises(ValueError, match=r"batch is 1 but this stream started with 2.*call reset\(\)"):
        decoder.decode(_latents(batch=1, frames=1))
    with pytest.raises(ValueError, match=r"frame size is \(4, 8\) but this stream started with \(4, 4\)"):
        decoder.decode(_latents(frames=1, w=8))
    vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                      tile_sample_stride_width=8)
    try:
        with pytest.raises(ValueError, match=r"spatial tiling .* but this stream started with False"):
            decoder.decode(_latents(frames=1))
    finally:
        vae.disable_tiling()
    assert decoder.latent_frames == 1
    encoder = StreamingVAEEncoder(vae)
    encoder.encode(_video(frames=2))
    with pytest.raises(ValueError, match=r"batch is 1 but this stream started with 2"):
        encoder.encode(_video(batch=1, frames=4))
    assert encoder.pending_frames == 1


def test_wrong_inputs_name_the_expected_shape(vae):
    with pytest.raises(ValueError, match=r"normalised latents \[batch, 16, frames, height, width\], got \(2, 4, 1"):
        StreamingVAEDecoder(vae).decode(_latents(frames=1, z_dim=4))
    with pytest.raises(ValueError, match=r"takes video frames \[batch, 3, frames, height, width\].*got \(1, 4, 2"):
        StreamingVAEEncoder(vae).encode(torch.zeros(1, 4, 2, 32, 32))
    with pytest.raises(TypeError, match="wraps a diffusers AutoencoderKLWan"):
        StreamingVAEDecoder(torch.nn.Conv3d(1, 1, 1))


# ---------------------------------------------------------------------------------------------- the canary
def test_the_vae_internals_this_module_drives_are_still_there(vae):
    """If this fails, a diffusers release changed the ``AutoencoderKLWan`` internals listed in the docstring of
    ``diffusers_causal_kv/streaming_vae.py``: re-read ``_decode``/``_encode``/``tiled_decode``/``tiled_encode`` and
    update the module's replicated loops (the bit-equality tests above say whether they still match)."""
    missing = _missing_internals(vae)
    assert missing == [], (f"diffusers {diffusers.__version__} changed the AutoencoderKLWan internals that "
                           f"diffusers_causal_kv.streaming_vae relies on: {missing}")
    # the decoder's and encoder's feature-cache loops: frame 0 alone, then one latent frame per step (4 video frames)
    latents, video = _latents(batch=1, frames=3), _video(batch=1, frames=9)
    assert torch.equal(torch.cat(stream_decode(StreamingVAEDecoder(vae), latents, [1, 1, 1]), 2),
                       stock_decode(vae, latents)), "streamed decode no longer equals AutoencoderKLWan.decode"
    assert torch.equal(torch.cat(stream_encode(StreamingVAEEncoder(vae), video, [1, 4, 4]), 2),
                       stock_encode(vae, video)), "streamed encode no longer equals AutoencoderKLWan.encode"
    del vae  # a VAE that lacks a relied-on internal is refused when the stream is built
    broken = tiny_vae(seed=0)
    del broken.post_quant_conv
    with pytest.raises(RuntimeError, match=r"internals that this diffusers release lacks: vae\.post_quant_conv"):
        StreamingVAEDecoder(broken)
