"""Grad-enabled forwards under a context (training): same values as no-grad reads, gradients through the
chunk, and gradient checkpointing that recomputes against the prefix the forward saw."""

import torch
from helpers import conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor


def _model(checkpointing=False):
    model = tiny_wan(layers=3)
    model.set_attn_processor(CausalWanAttnProcessor())
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model


def _grad_step(model, x, t, text, start):
    model.zero_grad()
    with CausalContext(model, start_frame=start):
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    return out, lambda: (out.square().mean().backward(), [p.grad.clone() for p in model.parameters()])[1]


def _prefill(model, text, frames=2):
    g = torch.Generator().manual_seed(3)
    for start in range(frames):
        forward(model, torch.randn(2, 16, 1, 4, 4, generator=g), torch.zeros(2), text, start_frame=start,
                store_kv=True)


def test_grad_forward_matches_no_grad_and_checkpointing_gives_same_grads():
    plain, ckpt = _model(), _model(checkpointing=True)
    text, _ = conditioning(plain)
    x, t = torch.randn(2, 16, 1, 4, 4), torch.full((2,), 600.0)
    for m in (plain, ckpt):
        _prefill(m, text)
    no_grad = forward(plain, x, t, text, start_frame=2)
    out_plain, backward_plain = _grad_step(plain, x, t, text, 2)
    out_ckpt, backward_ckpt = _grad_step(ckpt, x, t, text, 2)
    torch.testing.assert_close(out_plain.detach(), no_grad, rtol=0, atol=1e-6)
    assert torch.equal(out_plain.detach(), out_ckpt.detach())
    grads_plain, grads_ckpt = backward_plain(), backward_ckpt()
    assert all(g.abs().sum() > 0 for g in grads_plain[:3])
    for a, b in zip(grads_plain, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_committing_more_before_backward_changes_nothing():
    model = _model(checkpointing=True)
    text, _ = conditioning(model)
    _prefill(model, text)
    x, t = torch.randn(2, 16, 1, 4, 4), torch.full((2,), 600.0)
    _, backward_now = _grad_step(model, x, t, text, 2)
    expected = backward_now()

    model.kv_cache_engines["main"].clear()
    _prefill(model, text)
    _, backward_later = _grad_step(model, x, t, text, 2)
    # The rollout moves on before the loss is backpropagated: two more chunks committed, then a crop.
    forward(model, torch.randn(2, 16, 2, 4, 4), torch.zeros(2), text, start_frame=2, store_kv=True)
    forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=4, store_kv=True)
    model.kv_cache_engines["main"].crop(1)
    for a, b in zip(expected, backward_later()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_grad_commit_stages_detached_kv():
    model = _model(checkpointing=True)
    text, _ = conditioning(model)
    x = torch.randn(2, 16, 1, 4, 4, requires_grad=True)
    with CausalContext(model, store_kv=True):
        out = model(hidden_states=x, timestep=torch.zeros(2), encoder_hidden_states=text, return_dict=False)[0]
    engine = model.kv_cache_engines["main"]
    assert engine.num_frames("pos") == 1
    assert not any(t.requires_grad for t in engine.get_self_prefix(0, "pos"))
    out.sum().backward()  # the recomputation must not commit a second time
    assert engine.num_frames("pos") == 1 and x.grad is not None
