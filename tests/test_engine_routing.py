"""Which engine serves which module: registration, the engine map, and contexts on several transformers."""

import pytest
import torch
from helpers import conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, KVCacheEngine, get_current_context


def _installed(**kwargs):
    model = tiny_wan(**kwargs)
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def test_resolve_registered_engine_returns_the_owner():
    model = _installed()
    with CausalContext(model) as ctx:
        engine = model.kv_cache_engines["main"]
        for block in model.blocks:
            assert ctx.resolve_registered_engine(block.attn1) is engine
            assert ctx.resolve_registered_engine(block.attn2) is engine
        with pytest.raises(RuntimeError, match="No KV-cache engine of this CausalContext registered"):
            ctx.resolve_registered_engine(torch.nn.Linear(2, 2))


def test_unregistered_module_raises_under_a_context():
    model = _installed()
    text, _ = conditioning(model)
    with CausalContext(model):
        pass  # registers the current modules
    # Swap in a new attention module after registration: it is nobody's, so the processor must refuse it.
    old = model.blocks[1].attn1
    new = type(old)(dim=old.inner_dim, heads=old.heads, dim_head=old.inner_dim // old.heads, eps=1e-6,
                    cross_attention_dim_head=None, processor=CausalWanAttnProcessor())
    new.norm_q, new.norm_k = old.norm_q, old.norm_k
    model.blocks[1].attn1 = new
    model.kv_cache_engines["main"]._module_to_block.pop(id(new), None)
    ctx = CausalContext(model)
    ctx.__enter__()
    model.kv_cache_engines["main"]._module_to_block.pop(id(new), None)
    try:
        with pytest.raises(RuntimeError, match="registered the attention module"), torch.no_grad():
            model(hidden_states=torch.randn(2, 16, 1, 4, 4), timestep=torch.zeros(2), encoder_hidden_states=text)
    finally:
        ctx.__exit__(None, None, None)


def test_preexisting_engine_is_registered_into_not_replaced():
    model = _installed()
    mine = KVCacheEngine()
    model.kv_cache_engines = {"main": mine}
    with CausalContext(model):
        assert model.kv_cache_engines["main"] is mine
    assert mine.num_blocks == len(model.blocks) and mine.owns(model.blocks[0].attn2)


def test_cache_engines_argument_keeps_sessions_apart():
    model = _installed()
    text, _ = conditioning(model)
    session = {"main": KVCacheEngine()}
    forward(model, torch.randn(2, 16, 2, 4, 4), torch.zeros(2), text, start_frame=0, store_kv=True,
            cache_engines=session)
    assert session["main"].num_frames("pos") == 2
    assert model.kv_cache_engines["main"].num_frames("pos") == 0


@pytest.mark.parametrize("engines, match", [
    ({}, r"exactly the branches \['main'\]"),
    ({"main": KVCacheEngine(), "vace": KVCacheEngine()}, "exactly the branches"),
    ({"main": object()}, "not a KV-cache engine"),
])
def test_bad_engine_maps(engines, match):
    model = _installed()
    with pytest.raises((ValueError, TypeError), match=match):
        CausalContext(model, cache_engines=engines).__enter__()
    assert get_current_context(model) is None


def test_nested_contexts_on_two_transformers_use_their_own_engines():
    generator, critic = _installed(seed=0), _installed(seed=3, layers=3)
    text, _ = conditioning(generator)
    x, t = torch.randn(2, 16, 1, 4, 4), torch.zeros(2)
    forward(generator, x, t, text, start_frame=0, store_kv=True)
    alone = forward(generator, x, t, text, start_frame=1)
    with torch.no_grad(), CausalContext(generator, start_frame=1) as outer:
        with CausalContext(critic, store_kv=True, cache_tag="critic") as inner:
            assert get_current_context(generator) is outer and get_current_context(critic) is inner
            critic(hidden_states=x, timestep=t, encoder_hidden_states=text)
            # The generator still runs under its own context (and cache) while the critic's is open.
            nested = generator(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        assert get_current_context(critic) is None
    assert get_current_context(generator) is None
    assert torch.equal(nested, alone)
    gen_engine, critic_engine = generator.kv_cache_engines["main"], critic.kv_cache_engines["main"]
    assert gen_engine.tags() == ["pos"] and gen_engine.num_frames("pos") == 1
    assert critic_engine.tags() == ["critic"] and critic_engine.num_blocks == 3


def test_transformer_without_context_inside_another_context_runs_stock():
    causal, plain = _installed(), tiny_wan(seed=5)
    plain_installed = _installed(seed=5)
    text, _ = conditioning(causal)
    x, t = torch.randn(2, 16, 2, 4, 4), torch.full((2,), 400.0)
    stock = forward(plain, x, t, text)
    with torch.no_grad(), CausalContext(causal):
        inside = plain_installed(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    assert torch.equal(inside, stock)


def test_context_is_not_reentrant_but_reusable():
    model = _installed()
    ctx = CausalContext(model)
    with ctx, pytest.raises(RuntimeError, match="already open"):
        ctx.__enter__()
    with ctx:
        assert get_current_context(model) is ctx


def test_engine_maps_are_registered_once_and_again_after_a_replacement(monkeypatch):
    """Every open scans the modules, but registers an engine map only when it is new or a module or processor was
    replaced since (the per-forward cost of a context stays flat)."""
    model = _installed()
    text, _ = conditioning(model)
    calls = []
    original = KVCacheEngine.register_module
    monkeypatch.setattr(KVCacheEngine, "register_module",
                        lambda self, attn, idx: (calls.append(idx), original(self, attn, idx))[1])
    session = {"main": KVCacheEngine()}
    for _ in range(3):
        with CausalContext(model, cache_engines=session):
            pass
    per_map = 2 * len(model.blocks)
    assert len(calls) == 2 * per_map  # the transformer's own map and the session's, once each
    model.blocks[0].attn1.set_processor(CausalWanAttnProcessor())  # diffusers gives no notice of this
    with CausalContext(model, cache_engines=session):
        pass
    assert len(calls) == 4 * per_map
    with torch.no_grad(), CausalContext(model, cache_engines=session, store_kv=True):
        model(hidden_states=torch.randn(2, 16, 1, 4, 4), timestep=torch.zeros(2), encoder_hidden_states=text)
    assert session["main"].num_frames("pos") == 1 and len(calls) == 4 * per_map
