"""The causal Modular Pipelines blocks: the block sets keep the stock blocks around a causal core denoise step, and
running them gives exactly the latents of ``causal_rollout`` on the same inputs (T2V and I2V, few-step and scheduler
sampling, with and without guidance through the guider). Their misuse errors are cases of test_error_catalogue.py.

The stock ``WanTextEncoderStep`` always encodes ``prompt`` (a UMT5 encoder, and ``ftfy`` for its prompt cleaning), even
when ``prompt_embeds`` are passed, so these pipelines drop that sub-block and take the embeddings as inputs."""

from __future__ import annotations

import pathlib

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanBlocks, WanImage2VideoAutoBlocks
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from diffusers.modular_pipelines.wan.modular_blocks_wan_i2v import WanImage2VideoCoreDenoiseStep
from helpers import conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalWanAttnProcessor, KVCacheEngine, RolloutPlanner, causal_rollout
from diffusers_causal_kv.modular import (
    CausalWanCoreDenoiseStep,
    CausalWanImage2VideoCoreDenoiseStep,
    CausalWanImage2VideoDenoiseStep,
    CausalWanTextEncoderStep,
    causal_wan_blocks,
    causal_wan_i2v_blocks,
)
from diffusers_causal_kv.session import shifted_sigmas
from diffusers_causal_kv.testing import tiny_vae

FRAMES, H, W = 5, 4, 4  # latent frames and size; chunks of 2 give [3, 2] (the first chunk absorbs the remainder)
SEED = 7


def _pipeline(blocks, transformer, guidance_scale=1.0, decode=False, **components):
    """A modular pipeline of ``blocks`` without the text encoder step (and the VAE decoder unless ``decode``)."""
    blocks.sub_blocks.pop("text_encoder")
    if decode:
        components["vae"] = tiny_vae(seed=0)
    else:
        blocks.sub_blocks.pop("decode")
    pipe = blocks.init_pipeline()
    guider = components.pop("guider", None) or ClassifierFreeGuidance(guidance_scale=guidance_scale)
    pipe.update_components(transformer=transformer, guider=guider, **components)
    return pipe


def _noise(batch=1, frames=FRAMES):
    return torch.randn(batch, 16, frames, H, W, generator=torch.Generator().manual_seed(0))


def _flow_scheduler(kind):
    if kind == "unipc":  # the stock Wan2.1 scheduler
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def test_block_sets_replace_the_core_denoise_step_only():
    stock, causal = WanBlocks(), causal_wan_blocks()
    assert isinstance(causal, WanBlocks) and list(causal.sub_blocks) == list(stock.sub_blocks)
    assert isinstance(causal.sub_blocks["denoise"], CausalWanCoreDenoiseStep)
    assert type(causal.sub_blocks["decode"]) is type(stock.sub_blocks["decode"])
    # The text encoder step is the stock one, made to run without guidance too (diffusers 0.42's does not).
    assert type(causal.sub_blocks["text_encoder"]) is CausalWanTextEncoderStep
    assert isinstance(causal.sub_blocks["text_encoder"], type(stock.sub_blocks["text_encoder"]))
    # The core step keeps the stock input and prepare-latents steps and drops set_timesteps.
    assert list(causal.sub_blocks["denoise"].sub_blocks) == ["input", "prepare_latents", "denoise"]
    names = {param.name for param in causal.inputs}
    assert {"chunk_frames", "timesteps", "shift", "num_inference_steps", "context_noise", "cache_engines"} <= names
    assert "sigmas" not in names

    given = WanImage2VideoAutoBlocks()
    i2v = causal_wan_blocks(given)
    assert isinstance(given.sub_blocks["denoise"], WanImage2VideoCoreDenoiseStep)  # copied, not changed
    assert isinstance(i2v.sub_blocks["denoise"], CausalWanImage2VideoCoreDenoiseStep)
    assert type(causal_wan_i2v_blocks().sub_blocks["denoise"]) is CausalWanImage2VideoCoreDenoiseStep
    # The I2V workflows still resolve, through the causal step.
    workflow = i2v.get_workflow("image2video")
    assert isinstance(workflow.sub_blocks["denoise.denoise"], CausalWanImage2VideoDenoiseStep)


@pytest.mark.parametrize(
    "batch, chunk_frames, guidance_scale, sampling, context_noise, mode, session_engines",
    [
        (1, 2, 1.0, None, 0.0, "label", False),
        (2, [1, 2, 2], 3.0, None, 100.0, "renoise", False),
        (1, 2, 2.5, "unipc", 50.0, "label", True),
        (1, 3, 1.0, "flow_match", 0.0, "label", False),
    ],
    ids=["few-step", "few-step-cfg-batch2-renoise", "unipc-cfg-label-session-engines", "flow-match"],
)
def test_t2v_blocks_match_causal_rollout(batch, chunk_frames, guidance_scale, sampling, context_noise, mode,
                                         session_engines):
    transformer = tiny_wan()
    text, _ = conditioning(transformer, batch=batch)
    negative = torch.randn(text.shape, generator=torch.Generator().manual_seed(3))
    noise = _noise(batch)
    sampler = {} if sampling is None else {"num_inference_steps": 3}
    few_step = {} if sampling else {"timesteps": [1000, 700, 400], "shift": 3.0}
    engines = {"main": KVCacheEngine()} if session_engines else None
    components = {} if sampling is None else {"scheduler": _flow_scheduler(sampling)}
    pipe = _pipeline(causal_wan_blocks(), transformer, guidance_scale, **components)
    latents = pipe(prompt_embeds=text, negative_prompt_embeds=negative, latents=noise, chunk_frames=chunk_frames,
                   context_noise=context_noise, context_noise_mode=mode, cache_engines=engines,
                   generator=torch.Generator().manual_seed(SEED), output="latents", **sampler, **few_step)

    reference_engines = {"main": KVCacheEngine()} if session_engines else None
    # The guider runs one forward per tag: so does the reference (cfg_batch=False), for bitwise equality.
    reference = causal_rollout(
        transformer, noise, text, negative_prompt_embeds=negative, guidance_scale=guidance_scale,
        chunk_frames=chunk_frames, context_noise=context_noise, context_noise_mode=mode,
        cache_engines=reference_engines, cfg_batch=False,
        scheduler=None if sampling is None else _flow_scheduler(sampling),
        generator=torch.Generator().manual_seed(SEED), progress=False, **sampler, **few_step,
    )
    assert torch.equal(latents, reference.latents)
    tags = ["neg", "pos"] if guidance_scale != 1.0 else ["pos"]
    held = (engines or transformer.kv_cache_engines)["main"]
    assert sorted(held.tags()) == tags and all(held.num_frames(tag) == FRAMES for tag in tags)
    if session_engines:  # the rollout ran on the session's engines; the transformer's own stayed empty
        assert transformer.kv_cache_engines["main"].tags() == []


def test_i2v_blocks_match_causal_rollout():
    transformer = tiny_wan(i2v=True)
    text, image = conditioning(transformer, batch=1)
    negative = torch.randn(text.shape, generator=torch.Generator().manual_seed(3))
    condition = torch.randn(1, 20, FRAMES, H, W, generator=torch.Generator().manual_seed(4))
    noise = _noise()
    pipe = _pipeline(causal_wan_i2v_blocks(), transformer, guidance_scale=4.0, decode=True)
    out = pipe(prompt_embeds=text, negative_prompt_embeds=negative, image_condition_latents=condition,
               image_embeds=image, latents=noise, chunk_frames=2, generator=torch.Generator().manual_seed(SEED),
               output_type="pt", output=["latents", "videos"])
    reference = causal_rollout(transformer, noise, text, negative_prompt_embeds=negative, guidance_scale=4.0,
                               condition_latents=condition, image_embeds=image, chunk_frames=2, cfg_batch=False,
                               generator=torch.Generator().manual_seed(SEED), progress=False)
    assert torch.equal(out["latents"], reference.latents)
    assert out["videos"].shape[1:3] == (4 * (FRAMES - 1) + 1, 3)  # decoded by the stock VAE step


def test_guider_window_restarts_with_every_chunk_and_every_tag_is_committed():
    # CFG only in the first half of each chunk's steps: the guider's step counter restarts per chunk.
    transformer = tiny_wan()
    text, _ = conditioning(transformer, batch=1)
    negative = torch.randn(text.shape, generator=torch.Generator().manual_seed(3))
    noise, timesteps = _noise(), [1000, 750, 500, 250]
    pipe = _pipeline(causal_wan_blocks(), transformer, guider=ClassifierFreeGuidance(guidance_scale=3.0, stop=0.5))
    latents = pipe(prompt_embeds=text, negative_prompt_embeds=negative, latents=noise, chunk_frames=2,
                   timesteps=timesteps, generator=torch.Generator().manual_seed(SEED), output="latents")
    engine = transformer.kv_cache_engines["main"]
    assert engine.num_frames("pos") == engine.num_frames("neg") == FRAMES  # the 'neg' cache stays continuous

    # Reference: the few-step loop by hand on the planner, guided at steps 0 and 1 of each chunk only.
    planner = RolloutPlanner(transformer, text, negative_prompt_embeds=negative, guidance_scale=3.0,
                             generator=torch.Generator().manual_seed(SEED), cfg_batch=False)  # as the guider
    sigmas = shifted_sigmas(timesteps, 5.0).tolist()
    chunks = planner.plan(noise, 2)
    planner.clear()
    outputs = []
    with torch.no_grad():
        for chunk in chunks:
            x = noise[:, :, chunk.offset:chunk.offset + chunk.size]
            for i, sigma in enumerate(sigmas):
                flow = (planner.flow(x, sigma * 1000, chunk) if i < 2
                        else planner.forward(x, sigma * 1000, chunk, "pos"))
                x0 = x - sigma * flow
                if i + 1 < len(sigmas):
                    x = planner.renoise(x0, sigmas[i + 1])
            planner.commit(x0, chunk)
            outputs.append(x0)
    assert torch.equal(latents, torch.cat(outputs, dim=2))


def test_disabled_guider_runs_the_pos_tag_only():
    transformer = tiny_wan()
    text, _ = conditioning(transformer, batch=1)
    noise = _noise()
    pipe = _pipeline(causal_wan_blocks(), transformer, guider=ClassifierFreeGuidance(guidance_scale=3.0, enabled=False))
    latents = pipe(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), latents=noise,
                   generator=torch.Generator().manual_seed(SEED), output="latents")
    reference = causal_rollout(transformer, noise, text, generator=torch.Generator().manual_seed(SEED), progress=False)
    assert torch.equal(latents, reference.latents)
    assert transformer.kv_cache_engines["main"].tags() == ["pos"]


def test_stock_processors_are_replaced_and_stay_stock_outside_a_context():
    transformer = tiny_wan()
    text, _ = conditioning(transformer, batch=1)
    assert {type(p) for p in transformer.attn_processors.values()} == {WanAttnProcessor}
    # What transformer.set_attention_backend("_native_math") sets per module (without its global side effect).
    for processor in transformer.attn_processors.values():
        processor._attention_backend = AttentionBackendName._NATIVE_MATH
    x, t = _noise(frames=2), torch.full((1,), 500.0)
    stock = forward(transformer, x, t, text)
    pipe = _pipeline(causal_wan_blocks(), transformer)
    pipe(prompt_embeds=text, latents=_noise(), timesteps=[1000], output="latents")
    processors = transformer.attn_processors.values()
    assert {type(p) for p in processors} == {CausalWanAttnProcessor}
    assert {p._attention_backend for p in processors} == {AttentionBackendName._NATIVE_MATH}
    assert torch.equal(forward(transformer, x, t, text), stock)


def test_the_shipped_model_runs_through_the_causal_blocks_without_guidance():
    """The path of a distilled causal checkpoint: loaded from a pipeline folder, a guider of scale 1 (the stock text
    encoder step of diffusers 0.42 fails there), equal to CausalWanPipeline from the same folder and noise."""
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv import CausalWanPipeline

    folder = pathlib.Path(__file__).parents[1] / "models" / "tiny-sprites"
    pipe = causal_wan_blocks().init_pipeline(str(folder))
    pipe.load_components(torch_dtype=torch.float32)
    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))
    args = dict(prompt="a red ball moving right", num_frames=9, height=32, width=32)
    video = pipe(**args, chunk_frames=3, timesteps=[1000, 750, 500, 250], shift=5.0, output="videos",
                 generator=torch.Generator().manual_seed(0))
    assert video.shape == (1, 9, 32, 32, 3)
    reference = CausalWanPipeline.from_pretrained(str(folder))
    latents = pipe(**args, chunk_frames=3, timesteps=[1000, 750, 500, 250], shift=5.0, output="latents",
                   generator=torch.Generator().manual_seed(0))
    # The stock prepare-latents step draws every frame's noise at once: the pipeline is given the same noise.
    # The re-noising continues the same generator.
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(reference._latent_shape(1, 9, 32, 32), generator=generator)
    expected = reference(**args, chunk_frames=3, timesteps=[1000, 750, 500, 250], shift=5.0, guidance_scale=1.0,
                         output_type="latent", latents=noise, generator=generator).frames
    torch.testing.assert_close(latents, expected, rtol=0, atol=1e-5)
