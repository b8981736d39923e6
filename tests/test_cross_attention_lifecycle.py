"""Cross-attention entries: zeroed with is_init=False, filled by the first store_kv forward, read by no-grad
forwards without any K/V projection, recomputed with gradients, zeroed by clear()."""

import pytest
import torch
from helpers import conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, clear_caches

pytestmark = pytest.mark.usefixtures("make_engine")  # run every test on each engine


def _projection_counter(model):
    calls = []
    for block in model.blocks:
        for name in ("to_k", "to_v", "add_k_proj", "add_v_proj"):
            module = getattr(block.attn2, name)
            if module is not None:
                module.register_forward_hook(lambda *_, n=name: calls.append(n))
    return calls


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_cached_reads_skip_projections_and_grad_recomputes(i2v):
    model = tiny_wan(i2v=i2v)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, image = conditioning(model)
    x = lambda: torch.randn(2, model.config.in_channels, 1, 4, 4)  # noqa: E731
    calls = _projection_counter(model)
    per_forward = len(model.blocks) * (4 if i2v else 2)

    forward(model, x(), torch.zeros(2), text, image, start_frame=0, store_kv=True)
    assert len(calls) == per_forward  # first commit projects and fills
    engine = model.kv_cache_engines["main"]
    assert engine.is_cross_init("pos")
    entry = engine.read_cross(0, "pos")
    assert entry is not None and (entry.key_img is not None) == i2v

    calls.clear()
    forward(model, x(), torch.full((2,), 700.0), text, image, start_frame=1)
    forward(model, x(), torch.zeros(2), text, image, start_frame=1, store_kv=True)
    assert calls == []  # no-grad denoise and commit read the cache

    calls.clear()
    with CausalContext(model, start_frame=2):
        out = model(hidden_states=x(), timestep=torch.full((2,), 700.0), encoder_hidden_states=text,
                    encoder_hidden_states_image=image, return_dict=False)[0]
    assert len(calls) == per_forward  # gradients enabled: recomputed from the conditioning
    out.sum().backward()
    assert model.blocks[0].attn2.to_k.weight.grad is not None  # the recomputed K/V carry gradients


def test_cached_and_recomputed_cross_kv_agree():
    model = tiny_wan(i2v=True)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, image = conditioning(model)
    forward(model, torch.randn(2, 36, 1, 4, 4), torch.zeros(2), text, image, start_frame=0, store_kv=True)
    x, t = torch.randn(2, 36, 1, 4, 4), torch.full((2,), 300.0)
    cached = forward(model, x, t, text, image, start_frame=1)
    with CausalContext(model, start_frame=1):
        recomputed = model(hidden_states=x, timestep=t, encoder_hidden_states=text,
                           encoder_hidden_states_image=image, return_dict=False)[0]
    torch.testing.assert_close(recomputed.detach(), cached, rtol=0, atol=1e-6)


def test_clear_drops_every_entry():
    """After clear_caches() an engine holds nothing: the cross entries are dropped (not zeroed for reuse), so the
    next commit fills new ones, with new conditioning, dtype or device."""
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=0, store_kv=True)
    engine = model.kv_cache_engines["main"]
    held = [engine.read_cross(b, "pos") for b in range(len(model.blocks))]
    assert all(e.key.abs().sum() > 0 for e in held)

    clear_caches(model)
    assert not engine.is_cross_init("pos") and engine.num_frames("pos") == 0
    assert engine.read_cross(0, "pos") is None and engine.tags() == [] and engine.memory_bytes() == 0

    other = torch.randn_like(text)
    forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), other, start_frame=0, store_kv=True)
    refilled = engine.read_cross(0, "pos")
    assert refilled is not held[0] and not torch.equal(refilled.key, held[0].key)


def test_first_commit_fills_cross_only_once():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=0, store_kv=True)
    engine = model.kv_cache_engines["main"]
    first = engine._cross_kv[1]["pos"].key.clone()
    forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=1, store_kv=True)
    assert torch.equal(engine._cross_kv[1]["pos"].key, first)
