"""Atomic commits: a store_kv forward that raises part-way (an error in block 2 of 3, KeyboardInterrupt, out of
memory) leaves every engine, branch and tag exactly as before, and the same commit can be retried."""

import pytest
import torch
from helpers import assert_same_snapshot, cache_snapshot, conditioning, forward, tiny_vace, tiny_wan

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
)
from diffusers_causal_kv.model import commits_together, forward_pass

pytestmark = pytest.mark.usefixtures("make_engine")  # run every test on each engine

FAULTS = {
    "error": lambda: RuntimeError("boom in block 2"),
    "keyboard_interrupt": KeyboardInterrupt,
    "out_of_memory": lambda: torch.OutOfMemoryError("CUDA out of memory (simulated)"),
}


def _rollout(model, text, chunks, extra=None, start=0):
    """Commit ``chunks`` on "pos" and "neg", interleaved, from latent frame ``start``."""
    for x in chunks:
        for tag in ("pos", "neg"):
            forward(model, x, torch.zeros(2), text, extra=extra and extra(start, x.shape[2]), start_frame=start,
                    cache_tag=tag, store_kv=True)
        start += x.shape[2]


def _model(vace: bool):
    model = tiny_vace() if vace else tiny_wan(layers=3)
    model.set_attn_processor(CausalWanAttnProcessor())
    with CausalContext(model):  # completes installation: the engines exist before the first commit
        pass
    return model


CASES = [(fault, first, False) for fault in sorted(FAULTS) for first in (True, False)]
CASES += [("error", first, True) for first in (True, False)]


@pytest.mark.parametrize("fault, first_commit, vace", CASES,
                         ids=[f"{'vace' if v else 't2v'}-{'first' if f else 'later'}-commit-{x}" for x, f, v in CASES])
def test_failed_forward_commits_nothing_and_can_be_retried(fault, first_commit, vace):
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 16, size, 4, 4, generator=g) for size in (2, 1, 2)]
    control = torch.randn(2, 24, 5, 4, 4, generator=g)

    def extra(start, size):
        return {"control_hidden_states": control[:, :, start:start + size]} if vace else None

    model, twin = _model(vace), _model(vace)
    text, _ = conditioning(model)
    done = 0 if first_commit else 2
    for m in (model, twin):
        _rollout(m, text, chunks[:done], extra)
    start = sum(c.shape[2] for c in chunks[:done])
    x = chunks[done]
    before = cache_snapshot(model)

    # Block 2 of the 3 main blocks; on VACE both VACE blocks have run (and staged) by then.
    def explode(*_):
        raise FAULTS[fault]()

    handle = model.blocks[2].register_forward_pre_hook(explode)
    with pytest.raises(BaseException) as caught:
        forward(model, x, torch.zeros(2), text, extra=extra(start, x.shape[2]), start_frame=start,
                cache_tag="pos", store_kv=True)
    handle.remove()
    assert type(caught.value) is type(FAULTS[fault]())
    assert_same_snapshot(before, cache_snapshot(model))
    for engine in model.kv_cache_engines.values():
        assert engine.num_frames("pos") == start and engine.is_cross_init("pos") == (not first_commit)

    # Retrying the same commit gives the cache a run without the fault has.
    _rollout(model, text, chunks[done:], extra, start)
    _rollout(twin, text, chunks[done:], extra, start)
    assert_same_snapshot(cache_snapshot(twin), cache_snapshot(model))


def test_fault_in_a_denoising_pass_changes_nothing():
    model = _model(vace=False)
    text, _ = conditioning(model)
    _rollout(model, text, [torch.randn(2, 16, 2, 4, 4)])
    before = cache_snapshot(model)
    handle = model.blocks[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        forward(model, torch.randn(2, 16, 1, 4, 4), torch.full((2,), 500.0), text, start_frame=2)
    handle.remove()
    assert_same_snapshot(before, cache_snapshot(model))


@pytest.mark.parametrize("make", [lambda: StaticKVCacheEngine(max_frames=8), lambda: RollingKVCacheEngine(4, 1)],
                         ids=["static", "rolling"])
def test_out_of_memory_allocating_a_later_block_on_a_first_commit(make, monkeypatch):
    """Engines that preallocate a tag's self K/V do it in the prepare phase: running out of memory at the second
    block's buffers leaves no block written, and the retry equals a commit that never failed."""
    model, twin = (tiny_wan(layers=3) for _ in range(2))
    for m in (model, twin):
        m.kv_cache_engines = {"main": make()}
        m.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    committing, allocations = [], []
    commit_passes, new_empty = forward_pass._commit_passes, torch.Tensor.new_empty

    def tracked_commit(passes):
        committing.append(True)
        try:
            commit_passes(passes)
        finally:
            committing.pop()

    def failing_new_empty(self, *args, **kwargs):
        if committing:
            allocations.append(args)
            if len(allocations) == 3:  # block 0 got keys and values; block 1's keys run out of memory
                raise torch.OutOfMemoryError("simulated")
        return new_empty(self, *args, **kwargs)

    monkeypatch.setattr(forward_pass, "_commit_passes", tracked_commit)
    monkeypatch.setattr(torch.Tensor, "new_empty", failing_new_empty)
    with pytest.raises(torch.OutOfMemoryError):
        forward(model, x, torch.zeros(2), text, store_kv=True)
    monkeypatch.undo()
    engine = model.kv_cache_engines["main"]
    assert engine.tags() == [] and engine.memory_bytes() == 0
    assert all(not tags for tags in engine._self_kv.values())
    for m in (model, twin):
        forward(m, x, torch.zeros(2), text, store_kv=True)
    assert_same_snapshot(cache_snapshot(twin), cache_snapshot(model))


def test_commits_together_writes_every_held_commit_at_the_outermost_exit_or_none():
    model = _model(vace=False)
    text, _ = conditioning(model)
    engine = model.kv_cache_engines["main"]
    x = torch.randn(2, 16, 2, 4, 4)
    with pytest.raises(RuntimeError, match="after the first tag"), commits_together():
        forward(model, x, torch.zeros(2), text, cache_tag="pos", store_kv=True)
        raise RuntimeError("after the first tag")
    assert engine.tags() == []
    with commits_together():
        with commits_together():
            forward(model, x, torch.zeros(2), text, cache_tag="pos", store_kv=True)
        assert engine.tags() == []  # held by the outer block
        forward(model, x, torch.zeros(2), text, cache_tag="neg", store_kv=True)
        assert engine.tags() == []
    assert engine.num_frames("pos") == engine.num_frames("neg") == 2
