"""Self-forcing training rollouts: gradients against a cache-free reference whose prefix K/V are detached
explicitly, with and without gradient checkpointing, on every engine; no autograd state in the cache."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections
from helpers import block_causal_mask, conditioning, tiny_wan

from diffusers_causal_kv import CausalWanAttnProcessor, self_forcing_rollout
from diffusers_causal_kv.rotary import apply_rotary_emb
from diffusers_causal_kv.session import shifted_sigmas

FRAME_TOKENS = 4
CHUNKS = [1, 2, 2]
TIMESTEPS = [1000, 600, 300]
EXITS = [2, 0, 1]
BOUNDS = [sum(CHUNKS[:i]) for i in range(len(CHUNKS) + 1)]  # first frame of each chunk, and the end


class DetachedPrefixProcessor:
    """Stock Wan attention with a block-causal mask on self-attention whose first ``prefix_tokens`` keys and
    values are detached: what a cached chunk computes, written out by hand over the full sequence."""

    def __init__(self, mask: torch.Tensor, prefix_tokens: int):
        self.mask, self.prefix_tokens = mask, prefix_tokens

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None:
            query, key, value = _get_qkv_projections(attn, hidden_states, None)
            query, key = attn.norm_q(query), attn.norm_k(key)
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key, value = attn.norm_k(attn.to_k(encoder_hidden_states)), attn.to_v(encoder_hidden_states)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        mask = None
        if encoder_hidden_states is None:
            query, key = apply_rotary_emb(query, *rotary_emb), apply_rotary_emb(key, *rotary_emb)
            p = self.prefix_tokens
            key = torch.cat([key[:, :p].detach(), key[:, p:]], dim=1)
            value = torch.cat([value[:, :p].detach(), value[:, p:]], dim=1)
            mask = self.mask
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)), attn_mask=mask)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _reference_rollout(model, noise, text, generator, context=None):
    """The self-forcing rollout without a cache: every forward runs over the committed chunks plus the current
    one, the committed part's K/V detached, so gradients flow only through the current chunk. ``context``: clean
    latents of the first chunks of ``CHUNKS``, committed before the rollout (``noise`` covers the later ones)."""
    sigmas = shifted_sigmas(TIMESTEPS, 5.0).tolist()
    batch = noise.shape[0]
    committed, outputs, start = ([], [], 0) if context is None else ([context], [], context.shape[2])

    def flow(x, sigma):
        sizes = CHUNKS[:BOUNDS.index(start)] + [x.shape[2]]
        hidden = torch.cat(committed + [x], dim=2)
        prefix = start * FRAME_TOKENS
        t = torch.cat([torch.zeros(batch, prefix), torch.full((batch, x.shape[2] * FRAME_TOKENS), sigma * 1000)], 1)
        model.set_attn_processor(DetachedPrefixProcessor(block_causal_mask(sizes, FRAME_TOKENS), prefix))
        try:
            out = model(hidden_states=hidden, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        finally:
            model.set_attn_processor(WanAttnProcessor())
        return out[:, :, start:]

    first = BOUNDS.index(start)  # chunks the context holds
    for size, exit_at in zip(CHUNKS[first:], EXITS[first:]):
        x = noise[:, :, start - BOUNDS[first]:start - BOUNDS[first] + size]
        with torch.no_grad():
            for i in range(exit_at):
                x0 = x - sigmas[i] * flow(x, sigmas[i])
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(x0.shape, generator=generator)
        x0 = x - sigmas[exit_at] * flow(x, sigmas[exit_at])
        outputs.append(x0)
        committed.append(x0.detach())
        start += size
    return torch.cat(outputs, dim=2)


def _grads(model, latents):
    model.zero_grad()
    latents.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 16, sum(CHUNKS), 4, 4, generator=g)


def _assert_close_relative(actual, expected, rel=1e-4):
    for a, e in zip(actual, expected):
        scale = e.abs().max().clamp_min(1e-12)
        assert (a - e).abs().max() / scale < rel


@pytest.mark.parametrize("checkpointing", [None, "before", "after"],
                         ids=["plain", "checkpointing-enabled-before-install", "checkpointing-enabled-after-install"])
def test_self_forcing_gradients_equal_detached_prefix_reference(make_engine, checkpointing):
    model = tiny_wan(layers=3).train()
    text, _ = conditioning(model)
    noise = _inputs()
    expected_latents = _reference_rollout(model, noise, text, torch.Generator().manual_seed(9))
    expected = _grads(model, expected_latents)

    if checkpointing == "before":
        model.enable_gradient_checkpointing()
    model.set_attn_processor(CausalWanAttnProcessor())
    if checkpointing == "after":
        model.enable_gradient_checkpointing()
    result = self_forcing_rollout(model, noise, text, exit_step=EXITS, chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                                  generator=torch.Generator().manual_seed(9))
    assert result.exit_steps == EXITS and result.chunk_sizes == CHUNKS
    torch.testing.assert_close(result.latents.detach(), expected_latents.detach(), rtol=0, atol=1e-5)
    # Every chunk was committed (the rollout moved on) before backward(): the graph must not notice.
    assert model.kv_cache_engines["main"].num_frames("pos") == sum(CHUNKS)
    actual = _grads(model, result.latents)
    assert all(g.abs().sum() > 0 for g in actual[:4])
    _assert_close_relative(actual, expected)


def test_a_context_prefix_is_committed_clean_and_the_rollout_continues_it(make_engine):
    """``context_latents``: the first chunk comes from a clip, committed without gradients; the rest is generated
    against it, gradients and latents equal to the reference started from the same committed context."""
    model = tiny_wan(layers=2).train()
    text, _ = conditioning(model)
    clip = _inputs()
    context, noise = clip[:, :, :CHUNKS[0]], torch.randn(clip[:, :, CHUNKS[0]:].shape,
                                                          generator=torch.Generator().manual_seed(3))
    expected_latents = _reference_rollout(model, noise, text, torch.Generator().manual_seed(9), context=context)
    expected = _grads(model, expected_latents)
    model.set_attn_processor(CausalWanAttnProcessor())
    result = self_forcing_rollout(model, noise, text, exit_step=EXITS[1:], chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                                  generator=torch.Generator().manual_seed(9), context_latents=context)
    assert result.chunk_sizes == CHUNKS[1:] and result.latents.shape == noise.shape
    assert model.kv_cache_engines["main"].num_frames("pos") == sum(CHUNKS)
    torch.testing.assert_close(result.latents.detach(), expected_latents.detach(), rtol=0, atol=1e-5)
    _assert_close_relative(_grads(model, result.latents), expected)


def test_a_context_prefix_must_end_on_a_chunk_boundary_and_match_the_noise():
    model = tiny_wan(layers=1)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    clip = _inputs()
    engines_before = dict(getattr(model, "kv_cache_engines", {}))
    with pytest.raises(ValueError, match="chunk boundary"):
        self_forcing_rollout(model, clip[:, :, 2:], text, chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                             context_latents=clip[:, :, :2])
    with pytest.raises(ValueError, match="must match noise"):
        self_forcing_rollout(model, clip[:, :, 1:], text, chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                             context_latents=clip[:1, :, :1])
    assert dict(getattr(model, "kv_cache_engines", {})) == engines_before  # refused before any work


def test_cache_holds_no_autograd_state_and_backward_survives_later_commits(make_engine):
    model = tiny_wan(layers=2).train()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    result = self_forcing_rollout(model, _inputs(), text, exit_step=1, chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                                  context_noise=100.0, generator=torch.Generator().manual_seed(1))
    engine = model.kv_cache_engines["main"]
    held = [t for block in engine._self_kv for tag in engine._self_kv[block]
            for t in engine.get_self_prefix(block, tag)]
    held += [t for tags in engine._cross_kv.values() for entry in tags.values() for t in entry.tensors()]
    assert held and not any(t.requires_grad or t.grad_fn is not None for t in held)
    result.latents.sum().backward()  # would raise "modified by an inplace operation" if a commit hit the graph


def test_grad_from_frame_keeps_early_chunks_out_of_the_graph():
    model = tiny_wan(layers=2).train()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    result = self_forcing_rollout(model, _inputs(), text, exit_step=0, chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                                  grad_from_frame=3)
    model.zero_grad()
    result.latents[:, :, :3].sum().backward(retain_graph=True)  # chunks 0 and 1 start before frame 3
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    result.latents[:, :, 3:].sum().backward()
    assert any(p.grad is not None and p.grad.any() for p in model.parameters())


def test_exit_step_is_drawn_once_per_rollout_or_validated():
    model = tiny_wan(layers=1)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    def drawn(seed):
        with torch.no_grad():
            return self_forcing_rollout(model, _inputs(), text, chunk_frames=CHUNKS, timesteps=TIMESTEPS,
                                        generator=torch.Generator().manual_seed(seed)).exit_steps

    draws = {seed: drawn(seed) for seed in range(6)}
    assert all(len(set(d)) == 1 and 0 <= d[0] < len(TIMESTEPS) for d in draws.values())  # one per rollout
    assert drawn(3) == draws[3]  # reproducible from the generator
    assert len({d[0] for d in draws.values()}) > 1  # and drawn from it
    for bad in (3, -1, [0, 1]):
        with pytest.raises(ValueError, match="exit_step must be an index into the 3 timesteps"):
            self_forcing_rollout(model, _inputs(), text, exit_step=bad, chunk_frames=CHUNKS, timesteps=TIMESTEPS)
