"""Prompt switches that keep the cached frames: ``reset_conditioning`` (new cross-attention entries only) against a
cache whose cross entries were swapped by hand, and ``StreamingRollout.switch_prompt(mode=...)``."""

from __future__ import annotations

import pytest
import torch
from helpers import conditioning, forward, tiny_vace, tiny_wan

from diffusers_causal_kv import (
    CausalWanAttnProcessor,
    KVCacheEngine,
    RollingKVCacheEngine,
    StreamingRollout,
    reset_conditioning,
)

H = W = 4
ZERO = torch.zeros(1)
T = torch.full((1,), 700.0)


def _x(frames, seed=0, channels=16):
    return torch.randn(1, channels, frames, H, W, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make_engine", [KVCacheEngine, lambda: RollingKVCacheEngine(4, 1)], ids=["vanilla", "rolling"])
def test_reset_conditioning_equals_hand_swapped_cross_entries(make_engine):
    model = tiny_wan(layers=2)
    model.kv_cache_engines = {"main": make_engine()}
    model.set_attn_processor(CausalWanAttnProcessor())
    old, _ = conditioning(model, batch=1, seed=1)
    new, _ = conditioning(model, batch=1, seed=2)
    # Reference engines on the same model: one with the same frames under the old prompt, whose cross entries are
    # then overwritten by hand with those a fresh tag computes from the new prompt.
    hand, fresh = {"main": make_engine()}, {"main": make_engine()}
    for engines in (None, hand):
        for start in range(3):
            forward(model, _x(1, start), ZERO, old, start_frame=start, store_kv=True, cache_engines=engines)
    forward(model, _x(1, 9), ZERO, new, start_frame=0, store_kv=True, cache_engines=fresh)
    for block in range(2):
        hand["main"]._cross_kv[block]["pos"] = fresh["main"].read_cross(block, "pos")
    hand["main"]._tags["pos"].conditioning = fresh["main"]._tags["pos"].conditioning
    expected = forward(model, _x(2, 5), T, new, start_frame=3, cache_engines=hand)

    engine = model.kv_cache_engines["main"]
    self_before = [[t.clone() for t in engine.get_self_prefix(b, "pos")] for b in range(2)]
    reset_conditioning(model)
    assert not engine.is_cross_init("pos")
    for block, before in enumerate(self_before):
        assert all(torch.equal(a, b) for a, b in zip(before, engine.get_self_prefix(block, "pos")))
    assert torch.equal(forward(model, _x(2, 5), T, new, start_frame=3), expected)
    forward(model, _x(2, 5), ZERO, new, start_frame=3, store_kv=True)
    for block in range(2):
        assert all(torch.equal(a, b) for a, b in zip(engine.read_cross(block, "pos").tensors(),
                                                     fresh["main"].read_cross(block, "pos").tensors()))
    with pytest.raises(ValueError, match="other conditioning"):
        forward(model, _x(1), T, old, start_frame=5)  # the new prompt is now the tag's


def test_reset_conditioning_covers_every_branch_and_checks_first():
    model = tiny_vace()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model, batch=1)
    control = torch.randn(1, model.config.vace_in_channels, 1, H, W)
    forward(model, _x(1), ZERO, text, extra={"control_hidden_states": control}, start_frame=0, store_kv=True)
    engines = model.kv_cache_engines
    with pytest.raises(ValueError, match="is not filled on branches"):
        reset_conditioning(model, "neg")
    assert all(e.is_cross_init("pos") for e in engines.values())
    reset_conditioning(model)
    assert not any(e.is_cross_init("pos") for e in engines.values())


@pytest.mark.parametrize("mode", ["recache", "cross"])
def test_streaming_switch_prompt_modes(mode):
    model = tiny_wan(layers=2)
    model.kv_cache_engines = {"main": RollingKVCacheEngine(4, 1)}
    model.set_attn_processor(CausalWanAttnProcessor())
    old, _ = conditioning(model, batch=1, seed=1)
    new, _ = conditioning(model, batch=1, seed=2)
    stream = StreamingRollout(model, old, chunk_frames=2, timesteps=(1000, 500),
                              generator=torch.Generator().manual_seed(0))
    stream.generate(_x(4))
    engine = model.kv_cache_engines["main"]
    before = [t.clone() for t in engine.get_self_prefix(1, "pos")]  # block 0's self K/V precede any prompt
    stream.switch_prompt(new, mode=mode)
    after = engine.get_self_prefix(1, "pos")
    same_frames = all(torch.equal(a, b) for a, b in zip(before, after))
    assert same_frames == (mode == "cross")  # re-caching recomputes the held frames under the new prompt
    out = stream.generate(_x(2, 3))
    assert out.latents.shape[2] == 2 and engine.next_frame("pos") == 6
    with pytest.raises(ValueError, match="prompt switch mode must be"):
        stream.switch_prompt(old, mode="swap")
