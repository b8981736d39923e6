"""Wan2.2: TI2V-5B (48-channel latents, per-token timesteps, the image-to-video first frame at timestep 0) and the
two-expert A14B (``transformer`` at high noise, ``transformer_2`` below the boundary timestep), in rollouts, the
pipeline and streams.

Every cached forward is checked against one masked full-sequence stock forward over the committed prefix (of the
expert that ran it), computed from the inputs the forwards actually received (recorded with forward hooks)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
from helpers import assert_same_snapshot, block_causal_mask, cache_snapshot, masked_full_forward

from diffusers_causal_kv import (
    CausalConfig,
    CausalWanAttnProcessor,
    CausalWanPipeline,
    KVCacheEngine,
    RollingKVCacheEngine,
    RolloutPlanner,
    causal_rollout,
    get_current_context,
    prefill,
)
from diffusers_causal_kv.session import shifted_sigmas
from diffusers_causal_kv.testing import tiny_conditioning, tiny_pipeline_components, tiny_wan, tiny_wan22_vae

ATOL = 1e-5
H = W = 4  # latent size: 2 x 2 = 4 tokens per frame with patch (1, 2, 2)
FRAME_TOKENS = 4
BOUNDARY = 0.875  # Wan2.2 T2V-A14B's boundary_ratio
# With shift 5 these pass 1000, 952, 833 and 556 to the transformer: the timestep 800 runs on the high-noise expert
# (952 >= 875), because the expert is chosen on the timestep passed, after the shift.
STRADDLING = (1000, 800, 500, 200)


def tiny_ti2v(seed=0):
    """A tiny Wan2.2 TI2V-5B-like transformer: 48 latent channels in and out, nothing concatenated."""
    return tiny_wan(in_channels=48, out_channels=48, seed=seed)


class TwoExperts:
    """What the rollout helpers read of a two-expert (A14B) pipeline: the experts and the boundary in its config."""

    def __init__(self, transformer, transformer_2):
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.config = SimpleNamespace(boundary_ratio=BOUNDARY, expand_timesteps=False)


def two_experts(in_channels=16):
    experts = TwoExperts(tiny_wan(seed=0, in_channels=in_channels), tiny_wan(seed=1, in_channels=in_channels))
    for transformer in (experts.transformer, experts.transformer_2):
        transformer.set_attn_processor(CausalWanAttnProcessor())
    return experts


class Recorder:
    """Records every forward of a transformer under a context: tag, start frame, commit flag, inputs, output."""

    def __init__(self, transformer):
        self.transformer, self.calls = transformer, []
        self._handle = transformer.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        context = get_current_context(module)
        self.calls.append(dict(tag=context.cache_tag, start=context.start_frame, store=context.store_kv,
                               x=kwargs["hidden_states"].clone(), t=kwargs["timestep"].clone(),
                               text=kwargs["encoder_hidden_states"], image=kwargs["encoder_hidden_states_image"],
                               out=output[0].clone()))

    def remove(self):
        self._handle.remove()


def per_token(t, frames):
    """A timestep ``[batch]`` or per-token ``[batch, tokens]`` as per-token timesteps of ``frames`` frames."""
    return t if t.ndim == 2 else t[:, None].expand(-1, frames * FRAME_TOKENS)


def assert_matches_masked_full_forwards(transformer, calls):
    """Each recorded forward equals its chunk's slice of one stock forward over ``[committed chunks | chunk]`` of
    its tag (committed chunks at the timesteps their commits ran at) with a block-causal mask."""
    assert calls
    saved = transformer.attn_processors
    for call in calls:
        committed = sorted((c for c in calls if c["store"] and c["tag"] == call["tag"] and c["start"] < call["start"]),
                           key=lambda c: c["start"])
        assert sum(c["x"].shape[2] for c in committed) == call["start"]  # the prefix is every earlier chunk
        parts = [*committed, call]
        sizes = [c["x"].shape[2] for c in parts]
        x = torch.cat([c["x"] for c in parts], dim=2)
        t = torch.cat([per_token(c["t"], c["x"].shape[2]) for c in parts], dim=1)
        with torch.no_grad():
            ref = masked_full_forward(transformer, x, t, call["text"], call["image"],
                                      block_causal_mask(sizes, FRAME_TOKENS))
        err = (call["out"] - ref[:, :, call["start"]:]).abs().max().item()
        assert err < ATOL, f"{call['tag']} chunk at frame {call['start']} (commit={call['store']}): error {err:.2e}"
    transformer.set_attn_processor(saved)


# ------------------------------------------------------------------------------------------------ TI2V-5B
@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_ti2v_cached_forwards_equal_the_masked_full_forward_with_per_token_timesteps(i2v):
    model = tiny_ti2v()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = tiny_conditioning(model, batch=2)
    negative, _ = tiny_conditioning(model, batch=2, seed=5)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 48, 5, H, W, generator=g)
    image = torch.randn(2, 48, 1, H, W, generator=g) if i2v else None
    recorder = Recorder(model)
    out = causal_rollout(model, noise, text, negative_prompt_embeds=negative, guidance_scale=3.0,
                         chunk_frames=[2, 1, 2], timesteps=(1000, 500), context_noise=100.0, expand_timesteps=True,
                         first_frame_latents=image, generator=torch.Generator().manual_seed(1), progress=False,
                         cfg_batch=False)  # one recorded forward per tag
    recorder.remove()
    assert all(c["t"].shape == (2, c["x"].shape[2] * FRAME_TOKENS) for c in recorder.calls)  # per token
    first = [c for c in recorder.calls if c["start"] == 0]
    if i2v:  # frame 0 is the image, its tokens at timestep 0, in every forward of the first chunk and the result
        assert all(torch.equal(c["x"][:, :, :1], image) for c in first)
        assert all((c["t"][:, :FRAME_TOKENS] == 0).all() and (c["t"][:, FRAME_TOKENS:] > 0).all() for c in first)
        assert torch.equal(out.latents[:, :, :1], image)
    else:
        assert all((c["t"] > 0).all() for c in recorder.calls)
    assert_matches_masked_full_forwards(model, recorder.calls)


def _image(size, seed=0):
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8))


TIMESTEPS = [1000, 600, 300]


@torch.no_grad()  # as in the pipeline: the text encoder's kernels differ in the last bit with autograd on
def _embeds(pipe, negative=None):
    return pipe.encode_prompt("a ball", negative, do_classifier_free_guidance=negative is not None,
                              max_sequence_length=16, device=torch.device("cpu"))


def _ti2v_pipe(**config):
    components = tiny_pipeline_components(tiny_ti2v())
    components["vae"] = tiny_wan22_vae(seed=0)
    return CausalWanPipeline(**components, expand_timesteps=True,
                             causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS, **config))


def _a14b_pipe(in_channels=16, **config):
    return CausalWanPipeline(**tiny_pipeline_components(tiny_wan(seed=0, in_channels=in_channels)),
                             transformer_2=tiny_wan(seed=1, in_channels=in_channels), boundary_ratio=BOUNDARY,
                             causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS, **config))


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_ti2v_pipeline_equals_the_rollout(i2v):
    pipe = _ti2v_pipe()
    size, frames = 64, 17  # 16x spatial compression: 4 x 4 latents; 5 latent frames
    noise = torch.randn(1, 48, 5, H, W, generator=torch.Generator().manual_seed(0))
    image = _image(size) if i2v else None
    out = pipe(prompt="a ball", image=image, height=size, width=size, num_frames=frames, latents=noise,
               max_sequence_length=16, generator=torch.Generator().manual_seed(3), output_type="latent").frames
    first = None
    if i2v:  # the stock WanImageToVideoPipeline(expand_timesteps=True) preparation: the image alone, encoded
        pixels = pipe.video_processor.preprocess(image, height=size, width=size)
        first = pipe._prepare_i2v_latents(pixels, 1, 48, size, size, frames, torch.float32, torch.device("cpu"),
                                          None, torch.zeros(noise.shape))[1]
        assert first.shape == (1, 48, 1, H, W)
        assert torch.equal(out[:, :, :1], first)
    positive, _ = _embeds(pipe)
    ref = causal_rollout(pipe.transformer, noise, positive, chunk_frames=2, timesteps=TIMESTEPS,
                         expand_timesteps=True, first_frame_latents=first,
                         generator=torch.Generator().manual_seed(3), progress=False)
    assert torch.equal(out, ref.latents)
    assert list(pipe.cache_memory_bytes()) == ["transformer"]


# ------------------------------------------------------------------------------------------------ A14B
def test_each_expert_equals_its_own_masked_full_forward_and_runs_on_its_side_of_the_boundary():
    experts = two_experts()
    text, _ = tiny_conditioning(experts.transformer, batch=1)
    negative, _ = tiny_conditioning(experts.transformer, batch=1, seed=5)
    noise = torch.randn(1, 16, 5, H, W, generator=torch.Generator().manual_seed(0))
    high, low = Recorder(experts.transformer), Recorder(experts.transformer_2)
    causal_rollout(experts, noise, text, negative_prompt_embeds=negative, guidance_scale=3.0, guidance_scale_2=2.0,
                   boundary_ratio=BOUNDARY, chunk_frames=[2, 1, 2], timesteps=STRADDLING, shift=5.0,
                   generator=torch.Generator().manual_seed(1), progress=False, cfg_batch=False)  # a forward per tag
    high.remove()
    low.remove()
    passed = [1000 * s for s in shifted_sigmas(STRADDLING, 5.0).tolist()]
    above = sum(t >= BOUNDARY * 1000 for t in passed)
    assert 0 < above < len(passed)  # the steps straddle the boundary
    for recorder, steps in ((high, above), (low, len(passed) - above)):
        denoising = [c for c in recorder.calls if not c["store"]]
        commits = [c for c in recorder.calls if c["store"]]
        assert len(denoising) == 3 * steps * 2  # chunks x steps on this side x tags
        assert len(commits) == 3 * 2  # every chunk committed on both tags, in both experts
    assert all(c["t"].item() >= BOUNDARY * 1000 for c in high.calls if not c["store"])
    assert all(c["t"].item() < BOUNDARY * 1000 for c in low.calls if not c["store"])
    for transformer in (experts.transformer, experts.transformer_2):
        assert {tag: transformer.kv_cache_engines["main"].num_frames(tag) for tag in ("pos", "neg")} == \
            {"pos": 5, "neg": 5}
    # Each expert's cached forwards attend to the prefix its own weights computed.
    assert_matches_masked_full_forwards(experts.transformer, high.calls)
    assert_matches_masked_full_forwards(experts.transformer_2, low.calls)


def test_expert_choice_follows_the_timestep_passed_at_every_step():
    experts = two_experts()
    text, _ = tiny_conditioning(experts.transformer, batch=1)
    planner = RolloutPlanner(experts, text, boundary_ratio=BOUNDARY)
    assert planner.expert_for(875.0).transformer is experts.transformer
    assert planner.expert_for(874.9).transformer is experts.transformer_2
    assert planner.expert_for(torch.tensor(999.0)).transformer is experts.transformer


def _commit_raising_in(transformer):
    def raise_on_commit(module, args, kwargs):
        if get_current_context(module).store_kv:
            raise RuntimeError("injected fault in the second expert's commit")
    return transformer.register_forward_pre_hook(raise_on_commit, with_kwargs=True)


def test_commits_land_in_both_experts_or_in_neither():
    experts = two_experts()
    text, _ = tiny_conditioning(experts.transformer, batch=1)
    negative, _ = tiny_conditioning(experts.transformer, batch=1, seed=5)
    planner = RolloutPlanner(experts, text, negative_prompt_embeds=negative, guidance_scale=3.0,
                             boundary_ratio=BOUNDARY)
    latents = torch.randn(1, 16, 4, H, W, generator=torch.Generator().manual_seed(0))
    chunks = planner.plan(latents, 2)
    planner.check(latents, chunks)
    planner.clear()
    part = [latents[:, :, c.offset:c.offset + c.size] for c in chunks]
    planner.commit(part[0], chunks[0])
    before = [cache_snapshot(experts.transformer), cache_snapshot(experts.transformer_2)]

    # The second expert fails in its forward (after the first expert staged both tags): nothing lands anywhere.
    handle = _commit_raising_in(experts.transformer_2)
    with pytest.raises(RuntimeError, match="injected fault"):
        planner.commit(part[1], chunks[1])
    handle.remove()
    assert_same_snapshot(before[0], cache_snapshot(experts.transformer))
    assert_same_snapshot(before[1], cache_snapshot(experts.transformer_2))

    # The second expert's engine refuses the write (its prepare phase): nothing lands anywhere either.
    engine = experts.transformer_2.kv_cache_engines["main"]
    original = engine.prepare_commit

    def refuse(*args, **kwargs):
        raise RuntimeError("injected fault in the second expert's engine")

    engine.prepare_commit = refuse
    with pytest.raises(RuntimeError, match="injected fault"):
        planner.commit(part[1], chunks[1])
    engine.prepare_commit = original
    assert_same_snapshot(before[0], cache_snapshot(experts.transformer))
    assert_same_snapshot(before[1], cache_snapshot(experts.transformer_2))

    planner.commit(part[1], chunks[1])  # and the chunk commits on both once the fault is gone
    for transformer in (experts.transformer, experts.transformer_2):
        assert all(transformer.kv_cache_engines["main"].num_frames(tag) == 4 for tag in ("pos", "neg"))


def test_two_expert_session_engines_continue_and_prefill_skips_on_both_experts():
    experts = two_experts()
    text, _ = tiny_conditioning(experts.transformer, batch=1)
    engines = {name: {"main": RollingKVCacheEngine(6, 1)} for name in ("transformer", "transformer_2")}
    clip = torch.randn(1, 16, 3, H, W, generator=torch.Generator().manual_seed(0))
    assert prefill(experts, clip[:, :, :1], text, chunk_frames=1, cache_engines=engines) == 1  # the sink
    assert prefill(experts, clip[:, :, 1:], text, start_frame=3, chunk_frames=2, cache_engines=engines) == 5
    assert [m["main"].next_frame("pos") for m in engines.values()] == [5, 5]
    noise = torch.randn(1, 16, 2, H, W, generator=torch.Generator().manual_seed(1))
    causal_rollout(experts, noise, text, chunk_frames=2, timesteps=STRADDLING, cache_engines=engines,
                   continue_cache=True, progress=False)
    assert [m["main"].next_frame("pos") for m in engines.values()] == [7, 7]
    assert experts.transformer.kv_cache_engines["main"].tags() == []  # the session's engines were used


def test_i2v_a14b_is_told_by_its_input_channels_and_takes_no_image_embeddings():
    pipe = _a14b_pipe(in_channels=36)  # 16 noisy + 4 mask + 16 image latent channels; no image encoder
    assert pipe.image_encoder is None
    with pytest.raises(ValueError, match="this transformer is an I2V model"):
        pipe(prompt="a ball", height=32, width=32, num_frames=9, max_sequence_length=16, output_type="latent")
    pipe.install_processors()
    recorder = Recorder(pipe.transformer)
    pipe(prompt="a ball", image=_image(32), height=32, width=32, num_frames=9, max_sequence_length=16,
         timesteps=STRADDLING, output_type="latent")
    recorder.remove()
    assert recorder.calls and all(c["x"].shape[1] == 36 and c["image"] is None for c in recorder.calls)


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_a14b_pipeline_equals_the_rollout_and_reports_memory_per_expert(i2v):
    pipe = _a14b_pipe(in_channels=36 if i2v else 16)
    noise = torch.randn(1, 16, 6, H, W, generator=torch.Generator().manual_seed(0))
    image = _image(32) if i2v else None
    out = pipe(prompt="a ball", negative_prompt="blurry", image=image, height=32, width=32, num_frames=21,
               latents=noise, max_sequence_length=16, guidance_scale=3.0, guidance_scale_2=2.0,
               timesteps=STRADDLING, generator=torch.Generator().manual_seed(3), output_type="latent").frames
    condition = None
    if i2v:
        pixels = pipe.video_processor.preprocess(image, height=32, width=32)
        condition = pipe._prepare_i2v_latents(pixels, 1, 16, 32, 32, 21, torch.float32, torch.device("cpu"), None,
                                              torch.zeros(noise.shape))[1]
    positive, negative = _embeds(pipe, "blurry")
    ref = causal_rollout(pipe, noise, positive, negative_prompt_embeds=negative, guidance_scale=3.0,
                         guidance_scale_2=2.0, condition_latents=condition, chunk_frames=2, timesteps=STRADDLING,
                         generator=torch.Generator().manual_seed(3), progress=False)
    assert torch.equal(out, ref.latents)
    memory = pipe.cache_memory_bytes()
    expected = {name: getattr(pipe, name).kv_cache_engines["main"].memory_bytes()
                for name in ("transformer", "transformer_2")}
    assert memory == expected and memory["transformer"] == memory["transformer_2"] > 0


# ------------------------------------------------------------------------------------------------ streams
def _rolling(pipe):
    maps = [{"main": RollingKVCacheEngine(4, 1, positions="relative")} for _ in range(2 if pipe.transformer_2 else 1)]
    return maps[0] if len(maps) == 1 else {"transformer": maps[0], "transformer_2": maps[1]}


@pytest.mark.parametrize("kind", ["ti2v-i2v", "a14b"])
def test_streamed_frames_equal_the_pipeline_call(kind):
    if kind == "a14b":
        pipe, size, extra = _a14b_pipe(num_frames=21, guidance_scale=3.0), 32, {"negative_prompt": "blurry"}
    else:  # the image's frame lies inside the first chunk of 2 latent frames
        pipe, size, extra = _ti2v_pipe(num_frames=21), 64, {"image": _image(64)}
    args = dict(prompt="a ball", height=size, width=size, max_sequence_length=16, **extra)
    expected = pipe(**args, generator=torch.Generator().manual_seed(4), cache_engines=_rolling(pipe)).frames
    engines = _rolling(pipe)
    stream = pipe.stream(**args, num_frames=21, generator=torch.Generator().manual_seed(4), cache_engines=engines)
    chunks = list(stream)
    assert [len(c.latent_frames) for c in chunks] == [2, 2, 2]
    np.testing.assert_array_equal(np.concatenate([c.frames for c in chunks], axis=1), expected)
    memory = pipe.cache_memory_bytes(engines)
    assert sum(memory.values()) + sum(t.nbytes for _, t in stream.session.window()) == stream.session.memory_bytes()
    assert list(memory) == (["transformer", "transformer_2"] if kind == "a14b" else ["transformer"])


def test_cache_memory_bytes_before_any_call_is_zero_per_expert():
    pipe = _a14b_pipe()
    assert pipe.cache_memory_bytes() == {"transformer": 0, "transformer_2": 0}
    engines = {"transformer": {"main": KVCacheEngine()}, "transformer_2": {"main": KVCacheEngine()}}
    assert pipe.cache_memory_bytes(engines) == {"transformer": 0, "transformer_2": 0}


# ------------------------------------------------------------------------------------------------ modular blocks
def _modular(blocks, keep_vae=False, **components):
    """A modular pipeline of ``blocks`` without the text encoder step (embeddings given) and the decoder."""
    for name in ("text_encoder", "decode"):
        blocks.sub_blocks.pop(name)
    pipe = blocks.init_pipeline()
    pipe.update_components(**components)
    return pipe


def test_wan22_block_sets_replace_the_core_denoise_step_and_the_vace_mask_encoder_only():
    from diffusers import Wan22Blocks, Wan22Image2VideoBlocks, Wan22VaceBlocks
    from diffusers.modular_pipelines.wan.encoders import WanVaceEncoderStep

    from diffusers_causal_kv import causal_wan22_blocks, causal_wan22_i2v_blocks, causal_wan22_vace_blocks
    from diffusers_causal_kv.modular import (
        CausalWan22CoreDenoiseStep,
        CausalWan22Image2VideoCoreDenoiseStep,
        CausalWan22VaceCoreDenoiseStep,
        CausalWanTextEncoderStep,
        CausalWanVaceEncoderStep,
    )

    made = {Wan22Blocks: (causal_wan22_blocks(), CausalWan22CoreDenoiseStep),
            Wan22Image2VideoBlocks: (causal_wan22_i2v_blocks(), CausalWan22Image2VideoCoreDenoiseStep),
            Wan22VaceBlocks: (causal_wan22_vace_blocks(), CausalWan22VaceCoreDenoiseStep)}
    for stock_class, (causal, core) in made.items():
        stock = stock_class()
        assert isinstance(causal, stock_class) and list(causal.sub_blocks) == list(stock.sub_blocks)
        assert isinstance(causal.sub_blocks["denoise"], core)
        assert "set_timesteps" not in causal.sub_blocks["denoise"].sub_blocks
        for name, block in causal.sub_blocks.items():
            if name == "vace_encoder":
                assert type(block) is CausalWanVaceEncoderStep and isinstance(block, WanVaceEncoderStep)
            elif name == "text_encoder":  # the stock step, made to run without guidance too
                assert type(block) is CausalWanTextEncoderStep and isinstance(block, type(stock.sub_blocks[name]))
            elif name != "denoise":
                assert type(block) is type(stock.sub_blocks[name])
        names = {spec.name for spec in causal.expected_components}
        assert {"transformer", "transformer_2", "guider", "guider_2"} <= names
        assert "boundary_ratio" in {spec.name for spec in causal.expected_configs}


def test_wan22_blocks_equal_the_pipeline_with_two_experts():
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv import causal_wan22_blocks

    pipe = _a14b_pipe()
    noise = torch.randn(1, 16, 6, H, W, generator=torch.Generator().manual_seed(0))
    expected = pipe(prompt="a ball", negative_prompt="blurry", height=32, width=32, num_frames=21, latents=noise,
                    max_sequence_length=16, guidance_scale=3.0, guidance_scale_2=2.0, timesteps=STRADDLING,
                    generator=torch.Generator().manual_seed(3), output_type="latent",
                    cfg_batch=False).frames  # the guider runs a forward per tag
    positive, negative = _embeds(pipe, "blurry")
    modular = _modular(causal_wan22_blocks(), transformer=pipe.transformer, transformer_2=pipe.transformer_2,
                       guider=ClassifierFreeGuidance(guidance_scale=3.0),
                       guider_2=ClassifierFreeGuidance(guidance_scale=2.0))
    assert modular.config.boundary_ratio == BOUNDARY
    high, low = Recorder(pipe.transformer), Recorder(pipe.transformer_2)
    latents = modular(prompt_embeds=positive, negative_prompt_embeds=negative, latents=noise, chunk_frames=2,
                      timesteps=STRADDLING, generator=torch.Generator().manual_seed(3), output="latents")
    high.remove()
    low.remove()
    assert torch.equal(latents, expected)
    assert high.calls and low.calls  # both experts ran, and each committed every chunk on both tags
    assert sum(c["store"] for c in high.calls) == sum(c["store"] for c in low.calls) == 3 * 2


def test_wan22_i2v_blocks_equal_the_pipeline_for_i2v_a14b():
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv import causal_wan22_i2v_blocks

    pipe = _a14b_pipe(in_channels=36)
    image = _image(32)
    noise = torch.randn(1, 16, 6, H, W, generator=torch.Generator().manual_seed(0))
    expected = pipe(prompt="a ball", image=image, height=32, width=32, num_frames=21, latents=noise,
                    max_sequence_length=16, timesteps=STRADDLING, generator=torch.Generator().manual_seed(3),
                    output_type="latent").frames
    positive, _ = _embeds(pipe)
    modular = _modular(causal_wan22_i2v_blocks(), transformer=pipe.transformer, transformer_2=pipe.transformer_2,
                       vae=pipe.vae, guider=ClassifierFreeGuidance(guidance_scale=1.0),
                       guider_2=ClassifierFreeGuidance(guidance_scale=1.0))
    latents = modular(prompt_embeds=positive, image=image, height=32, width=32, num_frames=21, latents=noise,
                      chunk_frames=2, timesteps=STRADDLING, generator=torch.Generator().manual_seed(3),
                      output="latents")
    assert torch.equal(latents, expected)


@pytest.mark.parametrize("experts", [1, 2], ids=["one-vace-model", "two-vace-experts"])
def test_causal_vace_through_the_wan22_vace_blocks_equals_the_pipeline(experts):
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv import causal_wan22_vace_blocks
    from diffusers_causal_kv.testing import tiny_vace

    second = {} if experts == 1 else {"transformer_2": tiny_vace(vace_in_channels=96, seed=1),
                                      "boundary_ratio": BOUNDARY}
    pipe = CausalWanPipeline(**tiny_pipeline_components(tiny_vace(vace_in_channels=96)), **second,
                             causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS))
    rng = np.random.default_rng(2)
    video = [PIL.Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(21)]
    mask = [PIL.Image.fromarray(np.full((32, 32), 255 * (i % 2), dtype=np.uint8)) for i in range(21)]
    noise = torch.randn(1, 16, 6, H, W, generator=torch.Generator().manual_seed(0))
    expected = pipe(prompt="a ball", video=video, mask=mask, conditioning_scale=0.7, height=32, width=32,
                    num_frames=21, latents=noise, max_sequence_length=16, timesteps=STRADDLING,
                    generator=torch.Generator().manual_seed(3), output_type="latent").frames
    positive, _ = _embeds(pipe)
    modular = _modular(causal_wan22_vace_blocks(), transformer=pipe.transformer, vae=pipe.vae,
                       guider=ClassifierFreeGuidance(guidance_scale=1.0),
                       **({} if experts == 1 else {"transformer_2": pipe.transformer_2,
                                                   "guider_2": ClassifierFreeGuidance(guidance_scale=1.0)}))
    latents = modular(prompt_embeds=positive, video=video, mask=mask, conditioning_scale=0.7, height=32, width=32,
                      num_frames=21, latents=noise, chunk_frames=2, timesteps=STRADDLING,
                      generator=torch.Generator().manual_seed(3), output="latents")
    assert torch.equal(latents, expected)
    assert pipe.transformer.kv_cache_engines["vace"].num_frames("pos") == 6


def test_i2v_a14b_streams_switch_prompts_by_cross_entries_only():
    """Its window's condition latents are not kept, so a re-cache (which would run without them) is refused."""
    from diffusers_causal_kv import StreamingRollout

    experts = two_experts(in_channels=36)
    text, _ = tiny_conditioning(experts.transformer, batch=1)
    stream = StreamingRollout(experts, text, chunk_frames=2, timesteps=STRADDLING)
    stream.generate(torch.randn(1, 16, 2, H, W), condition_latents=torch.randn(1, 20, 2, H, W))
    with pytest.raises(NotImplementedError, match="re-caches text-conditioned streams only"):
        stream.switch_prompt(text + 1)
    stream.switch_prompt(text + 1, mode="cross")
    assert stream.prompts["pos"] is not text
