"""Stale-cache guards: cached K/V built from other conditioning or other weights are refused, with the cache
unchanged; after clear_caches() the cached rollout matches the masked stock reference again, LoRA included."""

import pytest
import torch
from helpers import (
    assert_same_snapshot,
    block_causal_mask,
    cache_snapshot,
    conditioning,
    forward,
    masked_full_forward,
    tiny_wan,
)
from peft import LoraConfig

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, clear_caches

H = W = 4
FRAME_TOKENS = 4
STALE = "K/V projection weights changed since cache tag 'pos' was filled"


def _lora_config():
    # init_lora_weights=False: random B, so the adapter changes the outputs from the start.
    return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                      init_lora_weights=False)


@pytest.fixture
def setup():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 16, 1, H, W, generator=g) for _ in range(2)]
    forward(model, chunks[0], torch.zeros(2), text, start_frame=0, store_kv=True)
    return model, text, chunks


def _assert_refused(model, text, chunks, match=STALE, error=RuntimeError):
    before = cache_snapshot(model)
    for store_kv in (False, True):
        with pytest.raises(error, match=match):
            forward(model, chunks[1], torch.zeros(2), text, start_frame=1, store_kv=store_kv)
    assert_same_snapshot(before, cache_snapshot(model))


def _assert_matches_reference(model, text, chunks):
    """Clear, roll out both chunks, compare the second with the masked stock forward over both."""
    clear_caches(model)
    forward(model, chunks[0], torch.zeros(2), text, start_frame=0, store_kv=True)
    t = torch.full((2,), 500.0)
    cached = forward(model, chunks[1], t, text, start_frame=1)
    per_token = torch.cat([torch.zeros(2, FRAME_TOKENS), torch.full((2, FRAME_TOKENS), 500.0)], dim=1)
    with torch.no_grad():
        ref = masked_full_forward(model, torch.cat(chunks, dim=2), per_token, text, None,
                                  block_causal_mask([1, 1], FRAME_TOKENS))
    torch.testing.assert_close(cached, ref[:, :, 1:], rtol=0, atol=1e-5)
    return cached


def test_other_prompt_for_a_filled_tag(setup):
    model, text, chunks = setup
    _assert_refused(model, text + 1e-3, chunks, match="built from other conditioning", error=ValueError)


def test_prompt_tensor_edited_in_place(setup):
    model, text, chunks = setup
    text.mul_(1.5)  # the same tensor object, other values
    _assert_refused(model, text, chunks, match="built from other conditioning", error=ValueError)


def test_optimizer_step_on_kv_projections(setup):
    model, text, chunks = setup
    optimizer = torch.optim.SGD([model.blocks[1].attn2.to_k.weight], lr=1e-2)
    model.blocks[1].attn2.to_k.weight.grad = torch.ones_like(model.blocks[1].attn2.to_k.weight)
    optimizer.step()
    _assert_refused(model, text, chunks)
    _assert_matches_reference(model, text, chunks)


def test_in_place_weight_edit(setup):
    model, text, chunks = setup
    with torch.no_grad():
        model.blocks[0].attn1.to_v.weight.mul_(1.01)
    _assert_refused(model, text, chunks)


def test_lora_load_set_adapters_fuse_and_unfuse(setup):
    model, text, chunks = setup
    plain = _assert_matches_reference(model, text, chunks)

    model.add_adapter(_lora_config(), adapter_name="style")
    _assert_refused(model, text, chunks)
    with_lora = _assert_matches_reference(model, text, chunks)
    assert not torch.allclose(with_lora, plain, atol=1e-3)  # the adapter is live in the cached path

    model.set_adapters(["style"], weights=[0.5])
    _assert_refused(model, text, chunks)
    half = _assert_matches_reference(model, text, chunks)

    model.fuse_lora(lora_scale=1.0)
    _assert_refused(model, text, chunks)
    fused = _assert_matches_reference(model, text, chunks)
    torch.testing.assert_close(fused, half, rtol=0, atol=1e-5)

    model.unfuse_lora()
    _assert_refused(model, text, chunks)
    _assert_matches_reference(model, text, chunks)

    model.disable_adapters()
    _assert_refused(model, text, chunks)
    torch.testing.assert_close(_assert_matches_reference(model, text, chunks), plain, rtol=0, atol=1e-5)


def test_unchanged_weights_pass_and_grad_steps_do_not_trip_the_guard(setup):
    model, text, chunks = setup
    model.train()
    with torch.enable_grad(), CausalContext(model, start_frame=1):
        out = model(hidden_states=chunks[1], timestep=torch.zeros(2), encoder_hidden_states=text,
                    return_dict=False)[0]
    out.sum().backward()  # gradients alone change no weights
    forward(model, chunks[1], torch.zeros(2), text, start_frame=1, store_kv=True)
    assert model.kv_cache_engines["main"].num_frames("pos") == 2
