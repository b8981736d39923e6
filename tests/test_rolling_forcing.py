"""The rolling-forcing sampler against Rolling Forcing's inference loop restated with stock diffusers forwards.

The reference restates TencentARC's ``CausalInferencePipeline.inference_rolling_forcing``
(``pipeline/rolling_forcing_inference.py``, read in the fork sk4161/RollingForcing at commit
d8f7bcaf51abee8fec8ad26ca85b8c93a190634e) and the cache reads of its ``CausalWanSelfAttention``
(``wan/modules/rolling_forcing_model.py`` in zengqunzhao/Relax-Forcing at commit
6d2b4fa57da381a4461490ec7c34bb150bc338ba): ``num_blocks + K - 1`` windows, window ``w`` covering blocks
``max(0, w - K + 1) .. min(num_blocks - 1, w)``; the per-block timesteps ``reversed(denoising_step_list)``, cut to
the window's last blocks while it grows and to its first blocks while it shrinks; the newest block taken from the
noise, the others from the re-noised cache; after the forward, every block not at its last step re-noised to its
next timestep with a fresh ``randn_like`` of the whole window (laid out ``[batch, frames, channels, h, w]``), the
finished block cached clean at ``context_noise``. Each window forward here is ONE stock forward (no plugin code)
over the clean frames before the window and the window, with per-token timesteps (``context_noise`` on the clean
frames) and a dense mask: clean chunk rows see what their commit saw, window rows see the cached frames the cache
offers and the whole window.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import block_causal_mask, masked_full_forward, window_mask

from diffusers_causal_kv import (
    CausalConfig,
    CausalWanAttnProcessor,
    CausalWanPipeline,
    RollingKVCacheEngine,
    causal_rollout,
)
from diffusers_causal_kv.testing import tiny_conditioning, tiny_pipeline_components, tiny_wan

FRAME_TOKENS = 4  # latent 4x4, patch (1, 2, 2)
ATOL = 1e-5


def _sigmas(timesteps, shift):
    """Self-Forcing's warp (``warp_denoising_step``), as noise levels: ``shift * s / (1 + (shift - 1) * s)``."""
    s = torch.tensor(timesteps, dtype=torch.float64) / 1000
    return (shift * s / (1 + (shift - 1) * s)).float().tolist()


def reference(model, noise, text, *, block, timesteps, shift, generator, context_noise=0.0, window=None,
              sink=0, relative=False):
    """Rolling Forcing's loop; ``noise`` is ``[batch, channels, frames, h, w]``, ``block`` frames per chunk.
    ``relative``: the window sees the sink and the recent clean frames numbered ``0, 1, ...`` before it, as
    Rolling Forcing re-indexes its sink next to the recent frames; one stock forward over just those frames and the
    window gives that numbering, and equals the cached pass on a one-layer model (whose cached K/V do not depend on
    what a frame attended to when it was committed)."""
    sigmas = _sigmas(timesteps, shift)
    steps, frames = len(sigmas), noise.shape[2]
    num_blocks = frames // block
    shared = list(reversed(range(steps)))  # step index per block of a full window, clean end first
    noisy_cache = torch.zeros_like(noise)
    output = torch.zeros_like(noise)
    for w in range(num_blocks + steps - 1):
        start, end = max(0, w - steps + 1), min(num_blocks - 1, w)
        n = end - start + 1
        lo, hi = start * block, (end + 1) * block
        if n == steps or start == 0:
            x = torch.cat([noisy_cache[:, :, lo:hi - block], noise[:, :, hi - block:hi]], dim=2)
        else:
            x = noisy_cache[:, :, lo:hi]
        if n == steps:
            step_of = shared
        elif start == 0:
            step_of = shared[-n:]
        else:
            assert hi == frames
            step_of = shared[:n]
        frame_sigma = torch.tensor([sigmas[k] for k in step_of]).repeat_interleave(block)
        seen = list(range(lo))
        if relative:  # the sink, then the recent frames the window reaches
            seen = [f for f in seen if f < sink or f >= lo - (window - sink - n * block)]
        sequence = torch.cat([output[:, :, seen], x], dim=2)
        per_token = torch.cat([torch.full((len(seen),), context_noise), frame_sigma * 1000])
        per_token = per_token.repeat_interleave(FRAME_TOKENS)[None].expand(noise.shape[0], -1)
        sizes = [block] * start + [n * block]
        if relative:
            mask = torch.ones(per_token.shape[1], per_token.shape[1], dtype=torch.bool)
        else:
            mask = (block_causal_mask(sizes, FRAME_TOKENS) if window is None
                    else window_mask(sizes, FRAME_TOKENS, window, sink))
        with torch.no_grad():
            flow = masked_full_forward(model, sequence, per_token, text, None, mask)[:, :, len(seen):]
        x0 = x - frame_sigma[None, None, :, None, None] * flow
        output[:, :, lo:hi] = x0
        for j, k in enumerate(step_of):
            if k == steps - 1:
                continue
            fresh = torch.randn((x0.shape[0], x0.shape[2], *x0.shape[1:2], *x0.shape[3:]), generator=generator)
            part = slice(j * block, (j + 1) * block)
            noisy_cache[:, :, lo + part.start:lo + part.stop] = (
                (1 - sigmas[k + 1]) * x0[:, :, part] + sigmas[k + 1] * fresh.transpose(1, 2)[:, :, part])
    return output


def _model(**config):
    model = tiny_wan(seed=3, **config)
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


@pytest.mark.parametrize("case", ["global", "sink_and_evicting_window", "release_window_relative"])
def test_rollout_equals_the_reference_loop(case):
    model = _model(layers=1) if case == "release_window_relative" else _model()
    text, _ = tiny_conditioning(model, batch=2, seed=5)
    noise = torch.randn(2, 16, 10, 4, 4, generator=torch.Generator().manual_seed(0))
    settings = dict(block=2, timesteps=(1000.0, 750.0, 500.0), shift=3.0)
    engines, window = None, {}
    if case != "global":
        # the sink is the first chunk; the window forward (6 frames) reads 1 recent frame, a commit 5: frames evict
        positions = "relative" if case == "release_window_relative" else "absolute"
        window = dict(window=9, sink=2, relative=positions == "relative")
        engines = {"main": RollingKVCacheEngine(9, 2, positions=positions)}
        settings["context_noise"] = 40.0
    expected = reference(model, noise, text, generator=torch.Generator().manual_seed(1), **settings, **window)
    out = causal_rollout(model, noise, text, chunk_frames=settings["block"], timesteps=settings["timesteps"],
                         shift=settings["shift"], context_noise=settings.get("context_noise", 0.0),
                         sampler="rolling_forcing", cache_engines=engines,
                         generator=torch.Generator().manual_seed(1), progress=False)
    assert out.chunk_sizes == [2] * 5
    assert (out.latents - expected).abs().max().item() < ATOL
    if engines:
        assert engines["main"].held_frames("pos")[1].start > 2  # the window evicted frames


def test_one_step_is_the_chunkwise_sampler():
    """With one timestep the window is one chunk: Rolling Forcing is chunk-by-chunk sampling (up to the rounding of
    per-frame against per-sample timesteps)."""
    model = _model()
    text, _ = tiny_conditioning(model, batch=1, seed=5)
    noise = torch.randn(1, 16, 6, 4, 4, generator=torch.Generator().manual_seed(0))
    runs = [causal_rollout(model, noise, text, chunk_frames=2, timesteps=(1000.0,), sampler=sampler,
                           progress=False).latents for sampler in ("chunkwise", "rolling_forcing")]
    assert (runs[0] - runs[1]).abs().max().item() < ATOL


def _pipe():
    config = CausalConfig(chunk_frames=1, timesteps=(1000, 600, 300), num_frames=21, sampler="rolling_forcing",
                          window_frames=5, sink_frames=1, positions="relative")
    return CausalWanPipeline(**tiny_pipeline_components(tiny_wan(seed=2)), causal_config=config)


def test_stream_gives_each_finished_chunk_and_equals_the_call():
    pipe = _pipe()
    args = dict(prompt="a red ball", height=32, width=32, max_sequence_length=16, num_frames=21, output_type="np")
    called = pipe(**args, generator=torch.Generator().manual_seed(4)).frames
    stream = pipe.stream(**args, generator=torch.Generator().manual_seed(4))
    session = stream.session
    made, in_window = [], []
    for chunk in stream:
        made.append(chunk.frames)
        in_window.append(session.pending_frames)
    # the first chunk comes after the warm-up (3 chunks in the window); the tail empties the window one by one
    assert in_window == [2, 2, 2, 2, 1, 0]
    assert abs(np.concatenate(made, axis=1) - called).max() < 1e-6


def test_a_failed_window_forward_is_run_again_with_the_same_draws():
    model = _model()
    text, _ = tiny_conditioning(model, batch=1, seed=5)
    noise = torch.randn(1, 16, 8, 4, 4, generator=torch.Generator().manual_seed(0))
    args = dict(chunk_frames=2, timesteps=(1000.0, 600.0), sampler="rolling_forcing", progress=False)
    expected = causal_rollout(model, noise, text, generator=torch.Generator().manual_seed(2), **args).latents
    calls = {"n": 0}

    def fail_once(module, inputs):
        calls["n"] += 1
        if calls["n"] == 4:  # the second chunk's window forward
            raise RuntimeError("injected")

    from diffusers_causal_kv.planner import RolloutPlanner
    from diffusers_causal_kv.rolling_forcing import make_session
    from diffusers_causal_kv.session import Sampling

    planner = RolloutPlanner(model, text, generator=torch.Generator().manual_seed(2))
    session = make_session(planner, Sampling.create((1000.0, 600.0), sampler="rolling_forcing"), sizes=[2] * 4,
                           latent_shape=(1, 16, 4, 4), latents=noise)
    handle = model.register_forward_pre_hook(fail_once)
    made = []
    try:
        while True:
            try:
                chunk = session.step()
            except RuntimeError:
                continue
            if chunk is None:
                break
            made.append(chunk.latents)
    finally:
        handle.remove()
    assert calls["n"] > 4 and torch.equal(torch.cat(made, dim=2), expected)


def test_sampler_is_a_validated_config_key():
    assert CausalConfig().sampler == "chunkwise"
    with pytest.raises(ValueError, match="sampler must be one of"):
        CausalConfig(sampler="rolling")


def test_scheduler_sampling_is_refused():
    model = _model()
    text, _ = tiny_conditioning(model, batch=1, seed=5)
    from diffusers import FlowMatchEulerDiscreteScheduler

    with pytest.raises(ValueError, match="runs every chunk alike"):
        causal_rollout(model, torch.randn(1, 16, 4, 4, 4), text, sampler="rolling_forcing",
                       scheduler=FlowMatchEulerDiscreteScheduler(), num_inference_steps=4, progress=False)


def test_a_first_chunk_of_its_own_timesteps():
    """Causal-Forcing++: the first chunk runs ``first_chunk_timesteps``, the others ``timesteps``: the same as a
    rollout of the first chunk with the first list continued by one of the rest with the other."""
    model = _model()
    text, _ = tiny_conditioning(model, batch=1, seed=5)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    first, rest = (1000.0, 750.0, 500.0, 250.0), (1000.0, 500.0)
    made = causal_rollout(model, noise, text, chunk_frames=1, timesteps=rest, first_chunk_timesteps=first,
                          generator=torch.Generator().manual_seed(3), progress=False).latents
    g = torch.Generator().manual_seed(3)
    head = causal_rollout(model, noise[:, :, :1], text, chunk_frames=1, timesteps=first, generator=g,
                          progress=False).latents
    tail = causal_rollout(model, noise[:, :, 1:], text, chunk_frames=1, timesteps=rest, generator=g,
                          continue_cache=True, progress=False).latents
    assert torch.equal(made, torch.cat([head, tail], dim=2))
    assert not torch.equal(made, causal_rollout(model, noise, text, chunk_frames=1, timesteps=rest, progress=False,
                                                generator=torch.Generator().manual_seed(3)).latents)
