"""Processors installed but no context open: the forward is the stock one, bit for bit."""

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from helpers import conditioning, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, uninstall_causal_kv


def _forward(model, x, t, text, image):
    with torch.no_grad():
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image,
                     return_dict=False)[0]


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("batch", [1, 2])
def test_no_context_is_bitwise_stock_and_uninstall_restores_it(i2v, batch):
    model = tiny_wan(i2v=i2v)
    text, image = conditioning(model, batch=batch)
    x = torch.randn(batch, model.config.in_channels, 3, 4, 4)
    t = torch.tensor([500.0, 250.0][:batch])
    stock = _forward(model, x, t, text, image)

    model.set_attn_processor(CausalWanAttnProcessor())
    assert torch.equal(_forward(model, x, t, text, image), stock)
    # After a context opened (engines registered, hooks installed), a context-free forward is still stock.
    with CausalContext(model, store_kv=True):
        _forward(model, x, t, text, image)
    assert torch.equal(_forward(model, x, t, text, image), stock)

    uninstall_causal_kv(model)
    assert all(type(p) is WanAttnProcessor for p in model.attn_processors.values())
    assert not hasattr(model, "kv_cache_engines")
    assert getattr(model, "_diffusers_hook", None) is None or model._diffusers_hook.get_hook("causal_kv") is None
    assert torch.equal(_forward(model, x, t, text, image), stock)


@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_attention_backend_is_respected(backend):
    model = tiny_wan()
    text, _ = conditioning(model)
    x = torch.randn(2, 16, 2, 4, 4)
    t = torch.tensor([500.0, 500.0])
    model.set_attention_backend(backend)
    stock = _forward(model, x, t, text, None)
    model.set_attn_processor(CausalWanAttnProcessor())
    model.set_attention_backend(backend)
    assert all(p._attention_backend is not None for p in model.attn_processors.values())
    assert torch.equal(_forward(model, x, t, text, None), stock)
    uninstall_causal_kv(model)
    assert all(str(p._attention_backend.value if hasattr(p._attention_backend, "value") else p._attention_backend)
               == backend for p in model.attn_processors.values())


def test_dict_form_of_set_attn_processor():
    model = tiny_wan()
    model.set_attn_processor({name: CausalWanAttnProcessor() for name in model.attn_processors})
    text, _ = conditioning(model)
    with CausalContext(model) as ctx:
        _forward(model, torch.randn(2, 16, 1, 4, 4), torch.tensor([1.0, 1.0]), text, None)
    assert set(model.kv_cache_engines) == {"main"}
    engine = model.kv_cache_engines["main"]
    assert ctx.cache_engines["main"] is engine
    for i, block in enumerate(model.blocks):
        assert engine.block_index(block.attn1) == i and engine.block_index(block.attn2) == i
