"""The static engine: no-grad reads are views of its preallocated buffers, commits copy nothing, grad-enabled
passes attend over fresh tensors, memory_bytes is the analytic size, and the capacity is checked before any work."""

import pytest
import torch
from helpers import assert_same_snapshot, cache_snapshot, conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, StaticKVCacheEngine
from diffusers_causal_kv.kv_cache.base import BaseKVCacheEngine

MAX_FRAMES = 6
BATCH, HEADS, HEAD_DIM, FRAME_TOKENS, TEXT_LEN = 2, 2, 12, 4, 12


@pytest.fixture
def model():
    model = tiny_wan(head_dim=HEAD_DIM, heads=HEADS)
    model.set_attn_processor(CausalWanAttnProcessor())
    model.kv_cache_engines = {"main": StaticKVCacheEngine(max_frames=MAX_FRAMES)}
    return model


def _x(frames, seed=0):
    return torch.randn(BATCH, 16, frames, 4, 4, generator=torch.Generator().manual_seed(seed))


def _commit(model, start, frames, seed=0, tag="pos"):
    return forward(model, _x(frames, seed), torch.zeros(BATCH), conditioning(model)[0], start_frame=start,
                   store_kv=True, cache_tag=tag)


class _AttentionSpy:
    """Records the self-attention K/V each engine hands back (wrapping the one call between processor and engine)."""

    def __init__(self, engine, monkeypatch):
        self.calls = []
        original = engine.update

        def spy(block_idx, info, key, value, rotary, memo=None):
            out = original(block_idx, info, key, value, rotary, memo)
            self.calls.append((block_idx, out.key, out.value))
            return out

        monkeypatch.setattr(engine, "update", spy)


def test_no_grad_reads_are_views_of_the_buffers(model, monkeypatch):
    engine = model.kv_cache_engines["main"]
    _commit(model, 0, 2)
    entry = engine._self_kv[0]["pos"]
    assert entry.keys.shape == (BATCH, MAX_FRAMES * FRAME_TOKENS, HEADS, HEAD_DIM) and entry.len == 8
    pointers = {b: (e["pos"].keys.data_ptr(), e["pos"].values.data_ptr()) for b, e in engine._self_kv.items()}

    spy = _AttentionSpy(engine, monkeypatch)
    forward(model, _x(1, 1), torch.full((BATCH,), 500.0), conditioning(model)[0], start_frame=2)
    assert engine._self_kv[0]["pos"].len == 8, "a denoising write must not advance the committed length"
    forward(model, _x(1, 1), torch.zeros(BATCH), conditioning(model)[0], start_frame=2, store_kv=True)
    assert engine._self_kv[0]["pos"].len == 12 and engine.num_frames("pos") == 3
    assert len(spy.calls) == 2 * len(model.blocks)
    for block_idx, key, value in spy.calls:
        buffers = engine._self_kv[block_idx]["pos"]
        for got, buffer in ((key, buffers.keys), (value, buffers.values)):
            assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert got.data_ptr() == buffer.data_ptr() and got.shape[1] == 12
    # The commit wrote nothing anew: same buffers, no reallocation.
    assert pointers == {b: (e["pos"].keys.data_ptr(), e["pos"].values.data_ptr()) for b, e in engine._self_kv.items()}


def test_committed_chunk_is_the_chunk_attended(model):
    """What the in-place write left after the prefix is exactly what a commit keeps (compared with the vanilla
    engine's copy of the same rollout)."""
    reference = tiny_wan(head_dim=HEAD_DIM, heads=HEADS)
    reference.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    for m in (model, reference):
        for start, size in ((0, 2), (2, 1), (3, 2)):
            forward(m, _x(size, start), torch.full((BATCH,), 700.0), text, start_frame=start)
            forward(m, _x(size, start + 10), torch.zeros(BATCH), text, start_frame=start, store_kv=True)
    for block in range(len(model.blocks)):
        ours = model.kv_cache_engines["main"].get_self_prefix(block, "pos")
        theirs = reference.kv_cache_engines["main"].get_self_prefix(block, "pos")
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_grad_passes_attend_over_fresh_tensors(model, monkeypatch):
    engine = model.kv_cache_engines["main"]
    _commit(model, 0, 2)
    spy = _AttentionSpy(engine, monkeypatch)
    text, _ = conditioning(model)
    with CausalContext(model, start_frame=2):
        out = model(hidden_states=_x(1, 3), timestep=torch.full((BATCH,), 500.0), encoder_hidden_states=text,
                    return_dict=False)[0]
    buffers = {engine._self_kv[b]["pos"].keys.untyped_storage().data_ptr() for b in engine._self_kv}
    buffers |= {engine._self_kv[b]["pos"].values.untyped_storage().data_ptr() for b in engine._self_kv}
    for _, key, value in spy.calls:
        assert key.untyped_storage().data_ptr() not in buffers and value.untyped_storage().data_ptr() not in buffers
    # A later commit (after a crop, over the same buffer region) does not disturb the graph's saved tensors.
    engine.crop(1)
    _commit(model, 1, 1, seed=5)
    out.sum().backward()


def test_memory_bytes_is_the_allocated_size(model):
    engine = model.kv_cache_engines["main"]
    assert engine.memory_bytes() == 0
    _commit(model, 0, 1)
    _commit(model, 0, 3, tag="neg")
    blocks, tags, itemsize = len(model.blocks), 2, 4
    self_bytes = blocks * tags * 2 * BATCH * MAX_FRAMES * FRAME_TOKENS * HEADS * HEAD_DIM * itemsize
    cross_bytes = blocks * tags * 2 * BATCH * TEXT_LEN * HEADS * HEAD_DIM * itemsize
    assert engine.memory_bytes() == self_bytes + cross_bytes
    _commit(model, 1, 2, seed=1)
    engine.crop(1)
    assert engine.memory_bytes() == self_bytes + cross_bytes  # allocated once, whatever is cached
    engine.clear()
    assert engine.memory_bytes() == 0  # after clear() the engine holds nothing


@pytest.mark.parametrize("store_kv", [False, True], ids=["denoise", "commit"])
def test_chunk_beyond_max_frames_fails_before_any_work(model, store_kv):
    _commit(model, 0, 4)
    calls = []
    model.patch_embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=r"frames 4..6 but this StaticKVCacheEngine holds at most 6 frames.*"
                                         r"StaticKVCacheEngine\(max_frames=7\)"):
        forward(model, _x(3), torch.zeros(BATCH), conditioning(model)[0], start_frame=4, store_kv=store_kv)
    assert calls == []
    assert_same_snapshot(before, cache_snapshot(model))
    _commit(model, 4, 2)  # exactly full is fine
    assert model.kv_cache_engines["main"].num_frames("pos") == MAX_FRAMES


def test_first_chunk_larger_than_max_frames():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    model.kv_cache_engines = {"main": StaticKVCacheEngine(max_frames=2)}
    with pytest.raises(ValueError, match=r"max_frames=3"):
        forward(model, _x(3), torch.zeros(BATCH), conditioning(model)[0], start_frame=0, store_kv=True)
    assert model.kv_cache_engines["main"].memory_bytes() == 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_max_frames_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_frames must be a positive int"):
        StaticKVCacheEngine(max_frames=bad)


def test_is_an_engine_with_a_readable_repr(model):
    engine = model.kv_cache_engines["main"]
    assert isinstance(engine, BaseKVCacheEngine)
    _commit(model, 0, 2)
    assert repr(engine).startswith("StaticKVCacheEngine(max_frames=6, blocks=2")
