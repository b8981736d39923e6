"""Soak: 500-chunk rollouts on a tiny model with the bounded engine. Memory stays constant, no engine tensor keeps
an autograd graph, and the number of live Python objects and tensors does not grow with the number of chunks."""

import gc

import pytest
import torch
from helpers import conditioning, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, RollingKVCacheEngine, StreamingRollout

CHUNKS = 500
WARMUP = 50  # chunks before the first count: the window is full and every lazily built table exists
H = W = 4


def _live_counts() -> tuple[int, int]:
    gc.collect()
    objects = gc.get_objects()
    return len(objects), sum(isinstance(o, torch.Tensor) for o in objects)


def _engine_tensors(engine):
    for tags in engine._self_kv.values():
        for entry in tags.values():
            yield from (t for t in (entry.keys, entry.values) if t is not None)
    for tags in engine._cross_kv.values():
        for entry in tags.values():
            yield from entry.tensors()


def _assert_flat(counts: list[tuple[int, int]]) -> None:
    """Live objects and tensors after WARMUP chunks and at the end: no growth per chunk (a leak of one object per
    chunk would add hundreds; a little slack for interpreter caches and lazily built tables)."""
    (objects_start, tensors_start), (objects_end, tensors_end) = counts[0], counts[-1]
    assert tensors_end - tensors_start < 10, counts
    assert objects_end - objects_start < 50, counts


def _install(engine):
    model = tiny_wan()
    model.kv_cache_engines = {"main": engine}
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


@pytest.mark.slow
def test_streaming_rollout_of_500_chunks_keeps_memory_and_objects_flat():
    engine = RollingKVCacheEngine(4, sink_frames=1, positions="relative")  # runs past the 32-frame RoPE table
    model = _install(engine)
    text, _ = conditioning(model, batch=1)
    other, _ = conditioning(model, batch=1, seed=7)
    rollout = StreamingRollout(model, text, negative_prompt_embeds=other, guidance_scale=3.0, chunk_frames=1,
                               timesteps=(1000, 500), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    engine_bytes, rollout_bytes, counts = set(), set(), []
    for chunk in range(CHUNKS):
        if chunk == CHUNKS // 2:
            rollout.switch_prompt(other, text)  # re-caching the window must not change the footprint either
        out = rollout.generate(torch.randn(1, 16, 1, H, W, generator=g))
        assert torch.isfinite(out.latents).all()
        if chunk >= 3:  # from the fourth chunk on the 4-frame window is full
            engine_bytes.add(engine.memory_bytes())
            rollout_bytes.add(rollout.memory_bytes())
        if chunk >= WARMUP and chunk % 150 == WARMUP % 150 or chunk == CHUNKS - 1:
            assert not any(t.requires_grad or t.grad_fn is not None for t in _engine_tensors(engine))
            del out
            counts.append(_live_counts())
    assert rollout.next_frame == engine.num_frames("pos") == engine.num_frames("neg") == CHUNKS
    assert len(engine_bytes) == 1 and len(rollout_bytes) == 1, (engine_bytes, rollout_bytes)
    _assert_flat(counts)


@pytest.mark.slow
def test_training_loop_of_500_chunks_retains_no_graph():
    """Self-forcing style: each chunk's denoising forward runs with gradients and is backpropagated, and its commit
    runs with gradients enabled too; the committed K/V must be detached, so no graph survives a chunk."""
    engine = RollingKVCacheEngine(3, positions="relative")
    model = _install(engine)
    model.train()
    text, _ = conditioning(model, batch=1)
    g = torch.Generator().manual_seed(2)
    engine_bytes, counts = set(), []
    for chunk in range(CHUNKS):
        x = torch.randn(1, 16, 1, H, W, generator=g)
        t = torch.full((1,), 500.0)
        with CausalContext(model, start_frame=chunk):
            out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        out.square().mean().backward()
        with CausalContext(model, start_frame=chunk, store_kv=True):
            model(hidden_states=out.detach(), timestep=torch.zeros(1), encoder_hidden_states=text,
                  return_dict=False)
        model.zero_grad(set_to_none=True)
        if chunk >= 1:
            engine_bytes.add(engine.memory_bytes())
        if chunk >= WARMUP and chunk % 150 == WARMUP % 150 or chunk == CHUNKS - 1:
            assert not any(t.requires_grad or t.grad_fn is not None for t in _engine_tensors(engine))
            del out
            counts.append(_live_counts())
    assert engine.num_frames("pos") == CHUNKS and len(engine_bytes) == 1
    _assert_flat(counts)
