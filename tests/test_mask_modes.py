"""CausalContext mask modes (training over whole sequences, no cache) against the cached rollout and against a
stock forward with the same mask."""

import pytest
import torch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from helpers import (
    assert_same_snapshot,
    cache_snapshot,
    conditioning,
    forward,
    masked_full_forward,
    tiny_vace,
    tiny_wan,
)

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    block_causal_mask,
    chunk_schedule,
    clear_caches,
    teacher_forcing_mask,
)

H = W = 4
FRAME_TOKENS = 4
ATOL = 1e-5


def _installed(model):
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _per_token(timesteps, sizes):
    """[batch, tokens] timesteps: ``timesteps[k]`` ([batch]) for every token of chunk k."""
    return torch.cat([t[:, None].expand(-1, s * FRAME_TOKENS) for t, s in zip(timesteps, sizes)], dim=1)


def _mode_forward(model, x, t, text, image=None, extra=None, **ctx):
    with CausalContext(model, **ctx):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image,
                     return_dict=False, **(extra or {}))[0]


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("chunk_frames", [[1, 2, 2], [3, 2], 2], ids=str)
def test_block_causal_mode_equals_cached_rollout(i2v, chunk_frames):
    """Diffusion forcing: one masked forward with per-chunk noise levels equals the cached rollout in which every
    chunk is committed at its own noise level. An int schedule gives the remainder to the first chunk."""
    model = _installed(tiny_wan(i2v=i2v))
    batch, frames = 2, 5
    chunks = chunk_schedule(frames, chunk_frames)
    text, image = conditioning(model, batch=batch)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, model.config.in_channels, frames, H, W, generator=g)
    levels = [torch.tensor([900.0, 700.0]) - 150.0 * k for k in range(len(chunks))]
    with torch.no_grad():
        full = _mode_forward(model, x, _per_token(levels, chunks), text, image, mode="block_causal",
                             chunk_frames=chunk_frames)
    assert model.kv_cache_engines["main"].tags() == []  # no cache involved
    start = 0
    for size, t in zip(chunks, levels):
        cached = forward(model, x[:, :, start:start + size], t, text, image, start_frame=start, store_kv=True)
        torch.testing.assert_close(full[:, :, start:start + size], cached, rtol=0, atol=ATOL)
        start += size


def test_block_causal_mode_equals_stock_masked_forward_with_window():
    model = _installed(tiny_wan(layers=3))
    text, _ = conditioning(model)
    x = torch.randn(2, 16, 6, H, W)
    t = torch.rand(2, 6 * FRAME_TOKENS) * 1000
    mask = block_causal_mask(6, 2, FRAME_TOKENS, window_frames=4, sink_frames=1)
    with torch.no_grad():
        ours = _mode_forward(model, x, t, text, mode="block_causal", chunk_frames=2, window_frames=4,
                             sink_frames=1)
        prebuilt = _mode_forward(model, x, t, text, mode="block_causal", mask=mask)
        ref = masked_full_forward(model, x, t, text, None, mask.dense())
    torch.testing.assert_close(ours, ref, rtol=0, atol=ATOL)
    assert torch.equal(ours, prebuilt)


@pytest.mark.parametrize("chunks", [[2, 2], [1, 3]], ids=str)
def test_teacher_forcing_noisy_half_equals_cached_chunks_after_the_clean_prefix(chunks):
    model = _installed(tiny_wan())
    batch, frames = 2, sum(chunks)
    text, _ = conditioning(model, batch=batch)
    g = torch.Generator().manual_seed(1)
    clean = torch.randn(batch, 16, frames, H, W, generator=g)
    noisy = torch.randn(batch, 16, frames, H, W, generator=g)
    zero = torch.zeros(batch)
    levels = [torch.tensor([800.0, 500.0]) - 100.0 * k for k in range(len(chunks))]
    t = torch.cat([_per_token([zero] * len(chunks), chunks), _per_token(levels, chunks)], dim=1)
    with torch.no_grad():
        out = _mode_forward(model, torch.cat([clean, noisy], dim=2), t, text, mode="teacher_forcing",
                            chunk_frames=chunks)
    start = 0
    for size, level in zip(chunks, levels):
        span = slice(start, start + size)
        noisy_out = forward(model, noisy[:, :, span], level, text, start_frame=start)
        clean_out = forward(model, clean[:, :, span], zero, text, start_frame=start, store_kv=True)
        torch.testing.assert_close(out[:, :, frames:][:, :, span], noisy_out, rtol=0, atol=ATOL)
        torch.testing.assert_close(out[:, :, span], clean_out, rtol=0, atol=ATOL)
        start += size


def test_vace_block_causal_mode_equals_stock_masked_forward():
    model = _installed(tiny_vace())
    text, _ = conditioning(model)
    x = torch.randn(2, 16, 4, H, W)
    control = torch.randn(2, model.config.vace_in_channels, 4, H, W)
    t = torch.tensor([700.0, 300.0])
    mask = block_causal_mask(4, 2, FRAME_TOKENS)
    extra = {"control_hidden_states": control}
    with torch.no_grad():
        ours = _mode_forward(model, x, t, text, extra=extra, mode="block_causal", chunk_frames=2)
        ref = masked_full_forward(model, x, t, text, None, mask.dense(), **extra)
    torch.testing.assert_close(ours, ref, rtol=0, atol=ATOL)


def test_flex_backend_gives_the_dense_result():
    model = _installed(tiny_wan())
    text, _ = conditioning(model)
    x, t = torch.randn(2, 16, 5, H, W), torch.rand(2, 5 * FRAME_TOKENS) * 1000
    with torch.no_grad():
        dense = _mode_forward(model, x, t, text, mode="block_causal", chunk_frames=[1, 2, 2])
        active = _AttentionBackendRegistry.get_active_backend()[0]
        model.set_attention_backend("flex")
        try:
            flex = _mode_forward(model, x, t, text, mode="block_causal", chunk_frames=[1, 2, 2])
        finally:  # set_attention_backend also sets the global default, which reset_attention_backend keeps
            model.reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(active)
    torch.testing.assert_close(flex, dense, rtol=0, atol=ATOL)


def test_mask_mode_leaves_the_cache_alone_and_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = _installed(tiny_wan(layers=3)).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        text, _ = conditioning(model)
        forward(model, torch.randn(2, 16, 2, H, W), torch.zeros(2), text, start_frame=0, store_kv=True)
        before = cache_snapshot(model)
        x = torch.randn(2, 16, 6, H, W, generator=torch.Generator().manual_seed(2))
        t = torch.rand(2, 6 * FRAME_TOKENS, generator=torch.Generator().manual_seed(3)) * 1000
        out = _mode_forward(model, x, t, text, mode="block_causal", chunk_frames=2)
        out.square().mean().backward()
        assert_same_snapshot(before, cache_snapshot(model))
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, ckpt in zip(*grads):
        torch.testing.assert_close(ckpt, plain, rtol=1e-4, atol=1e-7)


class TestBadInput:
    def test_mask_mode_with_store_kv(self):
        model = _installed(tiny_wan())
        with pytest.raises(ValueError, match="store_kv=True cannot apply"):
            CausalContext(model, mode="block_causal", chunk_frames=2, store_kv=True)

    def test_unknown_mode_and_misplaced_options(self):
        model = _installed(tiny_wan())
        with pytest.raises(ValueError, match="mode must be one of"):
            CausalContext(model, mode="causal")
        with pytest.raises(ValueError, match="only apply to the mask modes"):
            CausalContext(model, chunk_frames=2)
        with pytest.raises(ValueError, match="exactly one of chunk_frames"):
            CausalContext(model, mode="block_causal")
        with pytest.raises(ValueError, match="build it with the teacher_forcing_mask"):
            CausalContext(model, mode="teacher_forcing", mask=block_causal_mask(4, 2, FRAME_TOKENS))

    @pytest.mark.parametrize("case", ["mask_for_other_length", "timesteps_wrong_length", "odd_teacher_input"])
    def test_forward_errors_leave_the_cache_unchanged(self, case):
        model = _installed(tiny_wan())
        text, _ = conditioning(model)
        forward(model, torch.randn(2, 16, 1, H, W), torch.zeros(2), text, start_frame=0, store_kv=True)
        before = cache_snapshot(model)
        x, t = torch.randn(2, 16, 4, H, W), torch.full((2,), 500.0)
        ctx, match = {"mode": "block_causal", "chunk_frames": 2}, None
        if case == "mask_for_other_length":
            ctx = {"mode": "teacher_forcing", "mask": teacher_forcing_mask(4, 2, FRAME_TOKENS)}
            match = "covers 8 frames of 4 tokens but this forward has 4 frames"
        elif case == "timesteps_wrong_length":
            t, match = torch.zeros(2, 3 * FRAME_TOKENS), r"takes shape \[2\] .* or \[2, 16\]"
        else:
            x = torch.randn(2, 16, 3, H, W)
            ctx, match = {"mode": "teacher_forcing", "chunk_frames": 1}, "halves of equal length"
        with pytest.raises(ValueError, match=match):
            forward(model, x, t, text, **ctx)
        assert_same_snapshot(before, cache_snapshot(model))
        clear_caches(model)
