"""Every cached forward of a chunked rollout equals the matching slice of one full-sequence stock forward with a
block-causal mask and per-token timesteps (the reference uses no plugin code)."""

import pytest
import torch
from helpers import block_causal_mask, conditioning, masked_full_forward, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor

H = W = 4  # latent size: 2x2 = 4 tokens per frame with patch (1, 2, 2)
FRAME_TOKENS = 4
ATOL = 1e-5


def _reference(model, chunks, inputs, timesteps, text, image):
    """Full forward over ``inputs`` (one latent tensor per chunk so far), chunk k at ``timesteps[k]`` ([batch])."""
    x = torch.cat(inputs, dim=2)
    per_token = torch.cat(
        [t[:, None].expand(-1, size * FRAME_TOKENS) for t, size in zip(timesteps, chunks)], dim=1
    )
    mask = block_causal_mask(chunks, FRAME_TOKENS)
    with torch.no_grad():
        return masked_full_forward(model, x, per_token, text, image, mask)


def _cached(model, x, t, text, image, **ctx):
    with torch.no_grad(), CausalContext(model, **ctx):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image,
                     return_dict=False)[0]


def run_and_compare(model, chunks, tags=("pos", "neg"), batch=2, commit_t=0.0, steps=(900.0, 400.0)):
    """Roll out ``chunks`` with every tag interleaved, checking each cached forward against the reference."""
    channels = model.config.in_channels
    g = torch.Generator().manual_seed(7)
    cond = {tag: conditioning(model, batch=batch, seed=11 + i) for i, tag in enumerate(tags)}
    committed = {tag: [] for tag in tags}
    worst = 0.0
    for k, size in enumerate(chunks):
        start = sum(chunks[:k])
        seen = chunks[: k + 1]
        commit_ts = [torch.full((batch,), commit_t)] * k
        for step in steps + (None,):
            for tag in tags:
                text, image = cond[tag]
                x = torch.randn(batch, channels, size, H, W, generator=g)
                # Distinct timesteps per sample check that the batch dimension is kept apart.
                t = torch.full((batch,), commit_t) if step is None else step - 100.0 * torch.arange(batch)
                out = _cached(model, x, t, text, image, start_frame=start, cache_tag=tag, store_kv=step is None)
                ref = _reference(model, seen, committed[tag] + [x], commit_ts + [t], text, image)
                assert out.shape == (batch, 16, size, H, W)
                err = (out - ref[:, :, start:start + size]).abs().max().item()
                worst = max(worst, err)
                assert err < ATOL, f"chunk {k} ({size} frames) tag {tag} step {step}: max error {err:.2e}"
                if step is None:
                    committed[tag].append(x)
    for tag in tags:
        for engine in model.kv_cache_engines.values():
            assert engine.num_frames(tag) == sum(chunks)
    return worst


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("chunks", [[1, 1, 1], [3, 3, 3], [2, 1, 3]], ids=["chunk1", "chunk3", "uneven"])
def test_rollout_matches_block_causal_full_forward(chunks, i2v, make_engine):
    model = tiny_wan(i2v=i2v)
    model.set_attn_processor(CausalWanAttnProcessor())
    run_and_compare(model, chunks)


@pytest.mark.parametrize("head_dim", [24, 16], ids=["head24", "head16"])
@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_rope_split_follows_the_model(head_dim, i2v, make_engine):
    # 16 is not a multiple of 6: t/h/w split 8/4/4, which only the rope module's own dims give.
    model = tiny_wan(head_dim=head_dim, i2v=i2v)
    model.set_attn_processor(CausalWanAttnProcessor())
    run_and_compare(model, [1, 2, 2])


def test_context_noise_commit_and_single_tag_batch_one(make_engine):
    model = tiny_wan(layers=3)
    model.set_attn_processor(CausalWanAttnProcessor())
    run_and_compare(model, [2, 2, 1], tags=("pos",), batch=1, commit_t=80.0, steps=(1000.0,))


def test_reference_is_not_trivially_equal():
    """The block-causal mask matters: attending to the future chunk changes the first chunk's output."""
    model = tiny_wan()
    text, _ = conditioning(model)
    x = torch.randn(2, 16, 2, H, W)
    t = torch.full((2, 2 * FRAME_TOKENS), 500.0)
    with torch.no_grad():
        causal = masked_full_forward(model, x, t, text, None, block_causal_mask([1, 1], FRAME_TOKENS))
        full = masked_full_forward(model, x, t, text, None, block_causal_mask([2], FRAME_TOKENS))
    assert (causal[:, :, :1] - full[:, :, :1]).abs().max() > 1e-3
