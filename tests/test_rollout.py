"""causal_rollout against a cache-free reference loop (full masked forwards over everything generated so far)."""

import copy

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from helpers import block_causal_mask, conditioning, masked_full_forward, tiny_wan

from diffusers_causal_kv import CausalWanAttnProcessor, causal_rollout, chunk_schedule
from diffusers_causal_kv.session import shifted_sigmas

FRAME_TOKENS = 4


def test_chunk_schedule():
    assert chunk_schedule(21, 4) == [5, 4, 4, 4, 4]
    assert chunk_schedule(9, 3) == [3, 3, 3]
    assert chunk_schedule(2, 3) == [2]
    assert chunk_schedule(7, [1, 3, 3]) == [1, 3, 3]
    with pytest.raises(ValueError, match="adding up to the 7 latent frames"):
        chunk_schedule(7, [3, 3])
    with pytest.raises(ValueError, match="must be positive"):
        chunk_schedule(7, 0)


def test_shifted_sigmas_match_self_forcing_warp():
    # Self-Forcing warps [1000, 750, 500, 250] through its shift-5 scheduler table; t=1000 stays 1000.
    sigmas = shifted_sigmas([1000, 750, 500, 250], shift=5.0)
    expected = torch.tensor([1.0, 15 / 16, 5 / 6, 5 / 8])
    torch.testing.assert_close(sigmas, expected)
    with pytest.raises(ValueError, match=r"timesteps must lie in \(0, 1000\]"):
        shifted_sigmas([1000, 0])


class ReferenceLoop:
    """The same sampling loop with no cache: every forward runs over all committed chunks plus the current one."""

    def __init__(self, model, prompts, guidance_scale, cond=None, image=None):
        self.model, self.prompts, self.scale, self.cond, self.image = model, prompts, guidance_scale, cond, image
        self.committed, self.sizes, self.commit_ts = [], [], []

    def _forward(self, x, t, tag, start):
        inputs = self.committed + [x]
        sizes = self.sizes + [x.shape[2]]
        hidden = torch.cat(inputs, dim=2)
        if self.cond is not None:
            hidden = torch.cat([hidden, self.cond[:, :, : hidden.shape[2]]], dim=1)
        batch = x.shape[0]
        per_token = torch.cat([torch.full((batch, s * FRAME_TOKENS), float(v))
                               for s, v in zip(sizes, self.commit_ts + [t])], dim=1)
        with torch.no_grad():
            out = masked_full_forward(self.model, hidden, per_token, self.prompts[tag], self.image,
                                      block_causal_mask(sizes, FRAME_TOKENS))
        return out[:, :, start:]

    def flow(self, x, t, start):
        pos = self._forward(x, t, "pos", start)
        if self.scale == 1.0:
            return pos
        neg = self._forward(x, t, "neg", start)
        return neg + self.scale * (pos - neg)

    def commit(self, x, t):
        self.committed.append(x)
        self.sizes.append(x.shape[2])
        self.commit_ts.append(t)


def _reference_few_step(model, noise, prompts, sizes, timesteps, shift, scale, context_noise, generator,
                        mode="label", **kw):
    ref = ReferenceLoop(model, prompts, scale, **kw)
    sigmas = shifted_sigmas(timesteps, shift)
    start, out = 0, []
    for size in sizes:
        x = noise[:, :, start:start + size]
        for i, sigma in enumerate(sigmas.tolist()):
            x0 = x - sigma * ref.flow(x, sigma * 1000, start)
            if i + 1 < len(sigmas):
                n = torch.randn(x0.shape, generator=generator)
                x = (1 - sigmas[i + 1].item()) * x0 + sigmas[i + 1].item() * n
        committed = x0
        if context_noise and mode == "renoise":
            committed = (1 - context_noise / 1000) * x0 + context_noise / 1000 * torch.randn(x0.shape,
                                                                                           generator=generator)
        ref.commit(committed, context_noise)
        out.append(x0)
        start += size
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("scale, context_noise, chunks, mode",
                         [(1.0, 0.0, 3, "label"), (3.0, 0.0, [1, 2, 2], "label"), (2.0, 100.0, 2, "renoise"),
                          (2.0, 100.0, 2, "label")],
                         ids=["plain", "cfg", "cfg-context-noise-renoise", "cfg-context-noise-label"])
def test_few_step_rollout_matches_reference(scale, context_noise, chunks, mode):
    model = tiny_wan()
    text, _ = conditioning(model, batch=2)
    negative, _ = conditioning(model, batch=2, seed=9)
    frames = 5 if chunks != 3 else 6
    noise = torch.randn(2, 16, frames, 4, 4, generator=torch.Generator().manual_seed(0))
    sizes = chunk_schedule(frames, chunks)
    expected = _reference_few_step(model, noise, {"pos": text, "neg": negative}, sizes, [1000, 750, 500], 5.0,
                                   scale, context_noise, torch.Generator().manual_seed(42), mode)
    model.set_attn_processor(CausalWanAttnProcessor())
    result = causal_rollout(model, noise, text, negative_prompt_embeds=negative, guidance_scale=scale,
                            chunk_frames=chunks, timesteps=[1000, 750, 500], context_noise=context_noise,
                            context_noise_mode=mode,
                            generator=torch.Generator().manual_seed(42), progress=False)
    assert result.chunk_sizes == sizes and len(result.chunk_seconds) == len(sizes)
    torch.testing.assert_close(result.latents, expected, rtol=0, atol=1e-5)
    engine = model.kv_cache_engines["main"]
    assert engine.num_frames("pos") == frames
    assert engine.num_frames("neg") == (frames if scale != 1.0 else 0)


def test_scheduler_rollout_matches_reference():
    model = tiny_wan()
    text, _ = conditioning(model, batch=1)
    noise = torch.randn(1, 16, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref = ReferenceLoop(model, {"pos": text}, 1.0)
    reference_scheduler = copy.deepcopy(scheduler)
    out = []
    for start in (0, 2):
        x = noise[:, :, start:start + 2]
        reference_scheduler.set_timesteps(3)
        for t in reference_scheduler.timesteps:
            x = reference_scheduler.step(ref.flow(x, t.item(), start), t, x, return_dict=False)[0]
        ref.commit(x, 0.0)
        out.append(x)
    model.set_attn_processor(CausalWanAttnProcessor())
    result = causal_rollout(model, noise, text, chunk_frames=2, scheduler=scheduler, num_inference_steps=3,
                            progress=False)
    torch.testing.assert_close(result.latents, torch.cat(out, dim=2), rtol=0, atol=1e-5)


def test_i2v_rollout_slices_condition_latents():
    model = tiny_wan(i2v=True)
    text, image = conditioning(model, batch=1)
    noise = torch.randn(1, 16, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(1, 20, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    expected = _reference_few_step(model, noise, {"pos": text}, [2, 2], [1000, 500], 5.0, 1.0, 0.0,
                                   torch.Generator().manual_seed(3), cond=cond, image=image)
    model.set_attn_processor(CausalWanAttnProcessor())
    result = causal_rollout(model, noise, text, chunk_frames=2, timesteps=[1000, 500], condition_latents=cond,
                            image_embeds=image, generator=torch.Generator().manual_seed(3), progress=False)
    torch.testing.assert_close(result.latents, expected, rtol=0, atol=1e-5)


def test_rollout_clears_the_cache_between_runs():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model, batch=1)
    noise = torch.randn(1, 16, 3, 4, 4)
    first = causal_rollout(model, noise, text, chunk_frames=1, generator=torch.Generator().manual_seed(0),
                           progress=False)
    second = causal_rollout(model, noise, text, chunk_frames=1, generator=torch.Generator().manual_seed(0),
                            progress=False)
    assert torch.equal(first.latents, second.latents)


def test_rollout_argument_errors():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model, batch=1)
    noise = torch.randn(1, 16, 3, 4, 4)
    with pytest.raises(ValueError, match="needs negative_prompt_embeds"):
        causal_rollout(model, noise, text, guidance_scale=5.0, progress=False)
    with pytest.raises(ValueError, match="needs num_inference_steps"):
        causal_rollout(model, noise, text, scheduler=FlowMatchEulerDiscreteScheduler(), progress=False)
    with pytest.raises(ValueError, match="condition_latents has 2 frames but noise has 3"):
        causal_rollout(model, noise, text, condition_latents=torch.randn(1, 20, 2, 4, 4), progress=False)

    class TwoExpertPipeline:
        transformer, transformer_2 = model, tiny_wan()

    with pytest.raises(ValueError, match="needs boundary_ratio"):
        causal_rollout(TwoExpertPipeline(), noise, text, progress=False)


def test_rollout_past_the_rope_table_fails_before_any_work():
    model = tiny_wan(rope_max_seq_len=4)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model, batch=1)
    calls = []
    model.patch_embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=r"covers latent frames 0..5 but the RoPE table has 4 positions"):
        causal_rollout(model, torch.randn(1, 16, 6, 4, 4), text, chunk_frames=2, progress=False)
    assert calls == []
