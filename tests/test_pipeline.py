"""CausalWanPipeline: equal to causal_rollout on the same inputs, decoding as the stock pipelines do, from_pipe of
every stock Wan pipeline, callbacks, save/load, CPU offload, the causal config's defaults and the per-chunk noise
order."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline, WanVACEPipeline

from diffusers_causal_kv import CausalConfig, CausalWanAttnProcessor, CausalWanPipeline, causal_rollout
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_vace, tiny_wan

H = W = 32  # pixels: 4 x 4 latents
FRAMES = 21  # video frames: 6 latent frames
TIMESTEPS = [1000, 600, 300]
SEQ = 16  # text tokens


def _pipe(transformer=None, **config) -> CausalWanPipeline:
    return CausalWanPipeline(**tiny_pipeline_components(transformer), causal_config=CausalConfig(**config))


def _call(pipe, **kwargs):
    args = dict(prompt="a red ball bouncing", height=H, width=W, num_frames=FRAMES, timesteps=TIMESTEPS,
                max_sequence_length=SEQ, generator=torch.Generator().manual_seed(3), output_type="latent")
    args.update(kwargs)
    return pipe(**args).frames


@torch.no_grad()  # as in the pipeline: the text encoder's kernels differ in the last bit with autograd on
def _embeds(pipe, prompt="a red ball bouncing", negative=None, sequence_length=SEQ):
    pos, neg = pipe.encode_prompt(prompt, negative, do_classifier_free_guidance=negative is not None,
                                  max_sequence_length=sequence_length, device=torch.device("cpu"))
    return pos, neg


def _noise(pipe, batch=1, frames=6, seed=0):
    return torch.randn(batch, 16, frames, H // 8, W // 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_latents_equal_causal_rollout(cfg):
    pipe = _pipe(chunk_frames=2)
    noise = _noise(pipe)
    scale = 3.0 if cfg else 1.0
    out = _call(pipe, latents=noise, guidance_scale=scale, negative_prompt="blurry" if cfg else None)
    pos, neg = _embeds(pipe, negative="blurry" if cfg else None)
    ref = causal_rollout(pipe.transformer, noise, pos, negative_prompt_embeds=neg, guidance_scale=scale,
                         chunk_frames=2, timesteps=TIMESTEPS, generator=torch.Generator().manual_seed(3),
                         progress=False)
    assert torch.equal(out, ref.latents)
    assert pipe.num_timesteps == 3 * len(TIMESTEPS)


def test_noise_is_drawn_per_chunk_in_the_documented_order():
    """Per chunk: its noise, then its re-noising draws; equal to one causal_rollout per chunk on one generator."""
    pipe = _pipe(chunk_frames=3)
    out = _call(pipe, generator=torch.Generator().manual_seed(11))
    pos, _ = _embeds(pipe)
    generator, parts = torch.Generator().manual_seed(11), []
    for k in range(2):
        noise = torch.randn(1, 16, 3, H // 8, W // 8, generator=generator)
        parts.append(causal_rollout(pipe.transformer, noise, pos, chunk_frames=3, timesteps=TIMESTEPS,
                                    generator=generator, continue_cache=k > 0, progress=False).latents)
    assert torch.equal(out, torch.cat(parts, dim=2))


def test_scheduler_sampling_equals_causal_rollout():
    pipe = _pipe(chunk_frames=3)
    noise = _noise(pipe)
    out = _call(pipe, latents=noise, num_inference_steps=3)
    pos, _ = _embeds(pipe)
    ref = causal_rollout(pipe.transformer, noise, pos, chunk_frames=3, scheduler=pipe.scheduler,
                         num_inference_steps=3, progress=False)
    assert torch.equal(out, ref.latents)


def test_np_output_is_the_stock_decode_of_the_latents():
    pipe = _pipe(chunk_frames=3)
    latents = _call(pipe)
    frames = _call(pipe, output_type="np")
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents * std + mean).sample
    expected = pipe.video_processor.postprocess_video(video, output_type="np")
    assert frames.shape == (1, FRAMES, H, W, 3)
    np.testing.assert_allclose(frames, expected, rtol=0, atol=1e-6)
    pil = _call(pipe, output_type="pil")
    assert len(pil[0]) == FRAMES and isinstance(pil[0][0], PIL.Image.Image)


def test_causal_config_gives_the_defaults_and_calls_override_them():
    pipe = _pipe(chunk_frames=3, timesteps=TIMESTEPS, num_frames=FRAMES)
    noise = _noise(pipe)
    pos, _ = _embeds(pipe)
    out = pipe(prompt="a red ball bouncing", height=H, width=W, latents=noise, max_sequence_length=SEQ,
               output_type="latent", generator=torch.Generator().manual_seed(3)).frames
    ref = causal_rollout(pipe.transformer, noise, pos, chunk_frames=3, timesteps=TIMESTEPS,
                         generator=torch.Generator().manual_seed(3), progress=False)
    assert torch.equal(out, ref.latents)
    override = _call(pipe, latents=noise, chunk_frames=[1, 2, 3])
    ref = causal_rollout(pipe.transformer, noise, pos, chunk_frames=[1, 2, 3], timesteps=TIMESTEPS,
                         generator=torch.Generator().manual_seed(3), progress=False)
    assert torch.equal(override, ref.latents)


def test_context_noise_modes_follow_the_config():
    noise = None
    outs = {}
    for mode in ("label", "renoise"):
        pipe = _pipe(chunk_frames=3, context_noise=200.0, context_noise_mode=mode)
        noise = _noise(pipe) if noise is None else noise
        outs[mode] = _call(pipe, latents=noise)
        pos, _ = _embeds(pipe)
        ref = causal_rollout(pipe.transformer, noise, pos, chunk_frames=3, timesteps=TIMESTEPS, context_noise=200.0,
                             context_noise_mode=mode, generator=torch.Generator().manual_seed(3), progress=False)
        assert torch.equal(outs[mode], ref.latents)
    assert not torch.equal(outs["label"][:, :, 3:], outs["renoise"][:, :, 3:])


def test_window_config_installs_rolling_engines():
    from diffusers_causal_kv import RollingKVCacheEngine

    pipe = _pipe(chunk_frames=2, window_frames=4, sink_frames=1)
    _call(pipe)
    engine = pipe.transformer.kv_cache_engines["main"]
    assert isinstance(engine, RollingKVCacheEngine)
    held = engine.held_frames("pos")
    assert held[0] == range(0, 1) and held[-1].stop == 6 and sum(map(len, held)) <= 4


def test_callbacks_see_and_change_the_chunk_latents():
    pipe = _pipe(chunk_frames=3)
    seen = []

    def callback(p, step, t, kwargs):
        seen.append((step, round(float(t)), tuple(kwargs["latents"].shape)))
        if step == len(TIMESTEPS) - 1:  # the first chunk's clean latents
            return {"latents": torch.zeros_like(kwargs["latents"])}
        return {}

    out = _call(pipe, callback_on_step_end=callback)
    assert [s for s, _, _ in seen] == list(range(6))
    assert [t for _, t, _ in seen[:3]] == [1000, 882, 682]  # shifted by 5: sigma * 1000
    assert all(shape == (1, 16, 3, 4, 4) for _, _, shape in seen)
    assert torch.equal(out[:, :, :3], torch.zeros(1, 16, 3, 4, 4))
    assert out[:, :, 3:].abs().sum() > 0


def test_callback_changing_prompt_embeds_is_refused():
    pipe = _pipe(chunk_frames=3)

    def callback(p, step, t, kwargs):
        return {"prompt_embeds": kwargs["prompt_embeds"] + 1}

    with pytest.raises(ValueError, match="changed prompt_embeds in the middle of a chunk"):
        _call(pipe, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])


def test_interrupt_stops_after_the_current_chunk():
    pipe = _pipe(chunk_frames=2)

    def callback(p, step, t, kwargs):
        if step == 0:
            p._interrupt = True
        return {}

    out = _call(pipe, callback_on_step_end=callback)
    assert out.shape[2] == 2
    assert pipe.transformer.kv_cache_engines["main"].num_frames("pos") == 2


def _stock_components(transformer):
    components = tiny_pipeline_components(transformer)
    return components


def test_from_pipe_of_every_stock_wan_pipeline_keeps_the_components():
    for stock in (WanPipeline(**_stock_components(tiny_wan())),
                  WanImageToVideoPipeline(**_stock_components(tiny_wan(i2v=True)), image_encoder=None,
                                          image_processor=None),
                  WanVACEPipeline(**_stock_components(tiny_vace(vace_in_channels=96)))):
        pipe = CausalWanPipeline.from_pipe(stock)
        for name, component in stock.components.items():
            if name in pipe.components:
                assert pipe.components[name] is component, name
        assert {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(pipe.components)


def test_save_and_load_round_trip(tmp_path):
    pipe = _pipe(chunk_frames=2, timesteps=TIMESTEPS, num_frames=FRAMES)
    expected = _call(pipe)
    pipe.save_pretrained(tmp_path)
    assert (tmp_path / "causal_config.json").is_file()
    loaded = CausalWanPipeline.from_pretrained(tmp_path)
    assert loaded.causal_config == pipe.causal_config
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            loaded_state = loaded.components[name].state_dict()
            assert all(torch.equal(v, loaded_state[k]) for k, v in component.state_dict().items()), name
    # The same weights in other memory (safetensors' buffers) can take another CPU kernel path: last-bit differences.
    torch.testing.assert_close(_call(loaded), expected, rtol=0, atol=1e-5)


def test_model_cpu_offload():
    pipe = _pipe(chunk_frames=3)
    expected = _call(pipe, output_type="np")
    pipe.enable_model_cpu_offload(device="cpu")
    np.testing.assert_array_equal(_call(pipe, output_type="np"), expected)


def test_installs_the_processors_when_missing_and_keeps_installed_ones():
    pipe = _pipe()
    assert not any(isinstance(p, CausalWanAttnProcessor) for p in pipe.transformer.attn_processors.values())
    _call(pipe)
    assert all(isinstance(p, CausalWanAttnProcessor) for p in pipe.transformer.attn_processors.values())
    processor = CausalWanAttnProcessor()
    pipe.transformer.set_attn_processor(processor)
    _call(pipe)
    assert all(p is processor for p in pipe.transformer.attn_processors.values())


def test_i2v_equals_causal_rollout_with_the_stock_condition():
    pipe = _pipe(tiny_wan(i2v=True), chunk_frames=3)
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (H, W, 3), dtype=np.uint8))
    image_embeds = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(5))
    noise = _noise(pipe)
    out = _call(pipe, image=image, image_embeds=image_embeds, latents=noise, max_sequence_length=512)
    pixels = pipe.video_processor.preprocess(image, height=H, width=W)
    stock = WanImageToVideoPipeline(**{k: pipe.components[k] for k in
                                       ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")})
    _, condition = stock.prepare_latents(pixels, 1, 16, H, W, FRAMES, torch.float32, torch.device("cpu"), None, noise)
    pos, _ = _embeds(pipe, sequence_length=512)
    ref = causal_rollout(pipe.transformer, noise, pos, condition_latents=condition, image_embeds=image_embeds,
                         chunk_frames=3, timesteps=TIMESTEPS, generator=torch.Generator().manual_seed(3),
                         progress=False)
    assert torch.equal(out, ref.latents)


def test_vace_equals_causal_rollout_with_the_stock_control():
    pipe = _pipe(tiny_vace(vace_in_channels=96), chunk_frames=3)
    video = [PIL.Image.fromarray(np.full((H, W, 3), 10 * i, dtype=np.uint8)) for i in range(FRAMES)]
    noise = _noise(pipe)
    out = _call(pipe, video=video, conditioning_scale=0.5, latents=noise)
    stock = WanVACEPipeline(**{k: pipe.components[k] for k in
                               ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")})
    cpu = torch.device("cpu")
    v, m, refs = stock.preprocess_conditions(video, None, None, 1, H, W, FRAMES, torch.float32, cpu)
    control = torch.cat([stock.prepare_video_latents(v, m, refs, None, cpu), stock.prepare_masks(m, refs, None)], 1)
    pos, _ = _embeds(pipe)
    ref = causal_rollout(pipe.transformer, noise, pos, control_latents=control, control_scale=torch.full((2,), 0.5),
                         chunk_frames=3, timesteps=TIMESTEPS, generator=torch.Generator().manual_seed(3),
                         progress=False)
    assert torch.equal(out, ref.latents)
