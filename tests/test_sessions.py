"""One owner per rollout (issue #25): every way of using the pipeline and its streams that used to give wrong frames,
lose a chunk or crash, each against a reference computed another way (an undisturbed stream, a fresh pipeline, the
StreamingRollout driven with explicit embeddings, a call with fresh engines)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import AutoencoderKLWan
from helpers import assert_same_snapshot, cache_snapshot

from diffusers_causal_kv import CausalConfig, CausalWanPipeline, RollingKVCacheEngine, StreamingRollout
from diffusers_causal_kv.model import topology
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_vace, tiny_wan

H = W = 32
FRAMES = 21  # 6 latent frames in chunks of 2
SEQ = 16
TIMESTEPS = (1000, 600, 300)


def _pipe(transformer=None, **config) -> CausalWanPipeline:
    return CausalWanPipeline(**tiny_pipeline_components(transformer), causal_config=CausalConfig(
        chunk_frames=2, timesteps=TIMESTEPS, num_frames=FRAMES, **config))


def _engines(pipe, window=4, sink=1, positions="relative"):
    return {b: RollingKVCacheEngine(window, sink, positions=positions) for b in topology(pipe.transformer).branches}


def _args(**kwargs):
    return {"prompt": "a red ball", "height": H, "width": W, "max_sequence_length": SEQ, **kwargs}


def _seed(seed=0):
    return torch.Generator().manual_seed(seed)


def _frames(seed=0, count=FRAMES):
    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)) for _ in range(count)]


def _latents(chunks) -> torch.Tensor:
    return torch.cat([c.latents for c in chunks], dim=2)


@torch.no_grad()
def _embeds(pipe, text):
    return pipe.encode_prompt(text, do_classifier_free_guidance=False, max_sequence_length=SEQ)[0]


# 1, 2: a prompt switch keeps the stream's negative prompt, encoded with the stream's own guidance -------------------
@pytest.mark.parametrize("mode", ["recache", "cross"])
def test_guided_switch_keeps_the_negative_prompt_whichever_way_it_is_given(mode):
    pipe = _pipe(guidance_scale=3.0)
    common = dict(num_frames=FRAMES, negative_prompt="blurry", output_type="latent", prompt_switch=mode)
    by_text = _latents(pipe.stream(**_args(**common), generator=_seed(3), cache_engines=_engines(pipe),
                                   prompt_schedule={1: "a blue cube"}))
    stream = pipe.stream(**_args(**common), generator=_seed(3), cache_engines=_engines(pipe))
    got = [next(stream)]
    stream.switch_prompt(prompt_embeds=_embeds(pipe, "a blue cube"))
    by_embeds = _latents(got + list(stream))
    assert torch.equal(by_text, by_embeds)

    # The reference: the rollout driven with explicit embeddings, the negative prompt never touched.
    negative = _embeds(pipe, "blurry")
    generator = _seed(3)
    rollout = StreamingRollout(pipe.transformer, _embeds(pipe, "a red ball"), negative_prompt_embeds=negative,
                               guidance_scale=3.0, chunk_frames=2, timesteps=TIMESTEPS,
                               cache_engines=_engines(pipe), generator=generator)
    parts = []
    for k in range(3):
        if k == 1:
            rollout.switch_prompt(_embeds(pipe, "a blue cube"), mode=mode)
        parts.append(rollout.generate(torch.randn(1, 16, 2, 4, 4, generator=generator)).latents)
    assert torch.equal(by_text, torch.cat(parts, dim=2))
    assert torch.equal(stream.session.prompts["neg"], negative)


def test_a_call_in_between_does_not_change_how_a_paused_stream_encodes_its_switch():
    pipe = _pipe(guidance_scale=3.0)
    common = dict(num_frames=FRAMES, negative_prompt="blurry", output_type="latent")
    undisturbed = pipe.stream(**_args(**common), generator=_seed(5), cache_engines=_engines(pipe))
    paused = pipe.stream(**_args(**common), generator=_seed(5), cache_engines=_engines(pipe))
    expected, got = [next(undisturbed)], [next(paused)]
    pipe(**_args(), num_frames=5, guidance_scale=1.0, output_type="latent")  # unguided, on the pipeline's engines
    for stream in (undisturbed, paused):
        stream.switch_prompt("a blue cube", negative_prompt="grainy")
    expected += list(undisturbed)
    got += list(paused)
    assert torch.equal(_latents(expected), _latents(got))
    assert torch.equal(paused.session.prompts["neg"], _embeds(pipe, "grainy"))


# 3: engines follow the config a pipeline is given ----------------------------------------------------------------
@pytest.mark.parametrize("first, second", [({}, {"window_frames": 4, "sink_frames": 1}),
                                           ({"window_frames": 4, "sink_frames": 1}, {})])
def test_from_pipe_with_another_config_runs_the_engines_that_config_describes(first, second):
    windowed = {"window_frames": 4, "sink_frames": 1}
    p = _pipe(**first)
    p(**_args(), generator=_seed(1), output_type="latent")
    q = CausalWanPipeline.from_pipe(p, causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS,
                                                                  num_frames=FRAMES, **second))
    got = q(**_args(), generator=_seed(1), output_type="latent").frames
    fresh = _pipe(tiny_wan(), **second)
    fresh.transformer.load_state_dict(p.transformer.state_dict())
    expected = fresh(**_args(), generator=_seed(1), output_type="latent").frames
    assert torch.equal(got, expected)
    engine = q.transformer.kv_cache_engines["main"]
    assert getattr(engine, "window_frames", None) == (4 if second == windowed else None)


def test_engines_of_your_own_that_the_config_does_not_describe_are_refused_before_any_work():
    pipe = _pipe(window_frames=4, sink_frames=1)
    pipe.transformer.kv_cache_engines = {"main": RollingKVCacheEngine(6)}
    with pytest.raises(ValueError, match="but the pipeline's causal config describes"):
        pipe(**_args(), output_type="latent")
    assert pipe.transformer.kv_cache_engines["main"].window_frames == 6


# 4, 5: a transient error loses nothing, in both overlap modes -----------------------------------------------------
class _FailOnce:
    """A forward pre-hook that raises once, at the ``at``-th forward."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.fired = at, 0, False

    def __call__(self, module, args, kwargs):
        self.calls += 1
        if self.calls == self.at and not self.fired:
            self.fired = True
            raise RuntimeError("transient device error")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("at", [2, 5, 8])  # a denoising step of chunk 0, chunk 1's commit pass, chunk 2
def test_a_chunk_that_raised_is_made_again_with_the_same_noise(overlap, at):
    pipe = _pipe()
    expected = list(pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(7), cache_engines=_engines(pipe),
                                overlap=overlap))
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(7), cache_engines=_engines(pipe),
                         overlap=overlap)
    fault = _FailOnce(at)
    handle = pipe.transformer.register_forward_pre_hook(fault, with_kwargs=True)
    got, errors = [], 0
    try:
        while True:
            try:
                got.append(next(stream))
            except StopIteration:
                break
            except RuntimeError:
                errors += 1
    finally:
        handle.remove()
    assert fault.fired and errors == 1
    assert [c.index for c in got] == [0, 1, 2]
    assert [c.latent_frames for c in got] == [c.latent_frames for c in expected]
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, expected))
    # With overlap the CPU decode runs on a worker thread beside the transformer or alone (after a fault): intra-op
    # threads may split its reductions differently, a last-bit difference in the frames.
    np.testing.assert_allclose(np.concatenate([c.frames for c in got], axis=1),
                               np.concatenate([c.frames for c in expected], axis=1), rtol=0,
                               atol=1e-6 if overlap else 0)


# 6: a stream refuses to continue on engines another caller wrote ---------------------------------------------------
def test_a_call_on_a_streams_engines_is_detected_even_when_the_frame_counts_agree():
    pipe = _pipe()
    engines = _engines(pipe)
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(2), cache_engines=engines)
    next(stream)
    before = cache_snapshot(pipe.transformer)
    pipe(**_args(), num_frames=5, generator=_seed(9), cache_engines=engines)  # the same length and prompt
    assert engines["main"].next_frame("pos") == stream.session.next_frame
    with pytest.raises(RuntimeError, match="was written by another caller"):
        next(stream)
    assert_same_snapshot(before, cache_snapshot(pipe.transformer))


# 7: streams honour the config's positions, window and sink ---------------------------------------------------------
@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_a_stream_gives_the_frames_of_a_call_under_the_configs_window(positions):
    pipe = _pipe(window_frames=4, sink_frames=1, positions=positions)
    called = pipe(**_args(), generator=_seed(4), output_type="latent").frames
    streamed = _latents(pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(4), output_type="latent"))
    assert torch.equal(called, streamed)  # 6 frames through a window of 4: the window evicts


# 8: conditioned streams resume exactly ------------------------------------------------------------------------------
def _conditioned(kind):
    if kind == "i2v":
        pipe = _pipe(tiny_wan(i2v=True))
        return pipe, dict(image=_frames(1, 1)[0], image_embeds=torch.randn(1, 4, 8), max_sequence_length=512)
    if kind == "vace":
        pipe = _pipe(tiny_vace(vace_in_channels=96))
        mask = [PIL.Image.fromarray(np.full((H, W), 255 * (i % 2), dtype=np.uint8)) for i in range(FRAMES)]
        return pipe, dict(control_video=_frames(2), control_mask=mask)
    return _pipe(), dict(video=_frames(6), strength=0.7)


@pytest.mark.parametrize("kind", ["i2v", "vace", "v2v"])
def test_closing_and_resuming_a_conditioned_stream_changes_nothing(kind):
    pipe, extra = _conditioned(kind)
    whole = list(pipe.stream(**_args(**extra), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                             negative_prompt="blurry", guidance_scale=3.0))
    first = pipe.stream(**_args(**extra), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                        negative_prompt="blurry", guidance_scale=3.0)
    head = [next(first), next(first)]
    first.close()
    rest = list(pipe.stream(**_args(**extra), num_frames=8, resume=first))
    assert [c.index for c in head + rest] == [0, 1, 2]
    np.testing.assert_array_equal(np.concatenate([c.frames for c in head + rest], axis=1),
                                  np.concatenate([c.frames for c in whole], axis=1))


@pytest.mark.parametrize("kind", ["i2v", "vace"])
def test_a_cross_switch_of_a_conditioned_guided_stream_keeps_its_negative_prompt(kind):
    pipe, extra = _conditioned(kind)
    stream = pipe.stream(**_args(**extra), num_frames=FRAMES, negative_prompt="blurry", guidance_scale=3.0,
                         prompt_switch="cross", prompt_schedule={1: "a blue cube"}, output_type="latent")
    list(stream)
    with torch.no_grad():  # as in the stream: the text encoder's kernels differ in the last bit with autograd on
        negative = pipe.encode_prompt("blurry", do_classifier_free_guidance=False,
                                      max_sequence_length=extra.get("max_sequence_length", SEQ))[0]
    assert torch.equal(stream.session.prompts["neg"], negative)


# 9: a VACE stream without a control video or mask takes the stock defaults, as a call does --------------------------
@pytest.mark.parametrize("given", ["video", "mask", "neither"])
def test_vace_streams_take_a_control_video_or_mask_alone(given):
    pipe = _pipe(tiny_vace(vace_in_channels=96))
    video = _frames(2)
    mask = [PIL.Image.fromarray(np.full((H, W), 255 * (i % 2), dtype=np.uint8)) for i in range(FRAMES)]
    called = {"video": {"video": video}, "mask": {"mask": mask}, "neither": {}}[given]
    streamed = {"video": {"control_video": iter(video)}, "mask": {"control_mask": iter(mask)}, "neither": {}}[given]
    expected = pipe(**_args(**called), generator=_seed(4), cache_engines=_engines(pipe)).frames
    chunks = list(pipe.stream(**_args(**streamed), num_frames=FRAMES, generator=_seed(4),
                              cache_engines=_engines(pipe)))
    np.testing.assert_array_equal(np.concatenate([c.frames for c in chunks], axis=1), expected)


# 11: a re-cache an I2V or VACE stream cannot make is refused when asked for -----------------------------------------
@pytest.mark.parametrize("kind", ["i2v", "vace"])
def test_a_recache_switch_of_a_conditioned_stream_is_refused_before_any_work(kind):
    pipe, extra = _conditioned(kind)
    engines = _engines(pipe)
    with pytest.raises(NotImplementedError, match="re-caches text-conditioned streams only"):
        pipe.stream(**_args(**extra), num_frames=FRAMES, prompt_schedule={1: "a cube"}, cache_engines=engines)
    assert all(not engine.tags() for engine in engines.values())
    stream = pipe.stream(**_args(**extra), num_frames=FRAMES, prompt_switch="cross", cache_engines=engines)
    next(stream)
    with pytest.raises(NotImplementedError, match="re-caches text-conditioned streams only"):
        stream.switch_prompt("a cube", mode="recache")
    assert len(list(stream)) == 2  # nothing dropped, nothing short


# Smaller: frames as the VAE makes them --------------------------------------------------------------------------------
def test_a_vae_that_does_not_compress_time_gets_the_frames_asked_for(caplog):
    components = tiny_pipeline_components()
    torch.manual_seed(0)
    components["vae"] = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, False, False], scale_factor_temporal=1)
    pipe = CausalWanPipeline(**components, causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS))
    assert pipe.vae_scale_factor_temporal == 1
    called = pipe(**_args(), num_frames=6, generator=_seed(1)).frames
    assert called.shape[1] == 6 and "has to be divisible" not in caplog.text
    chunks = list(pipe.stream(**_args(), num_frames=6, generator=_seed(1), cache_engines=_engines(pipe)))
    assert [c.video_frames for c in chunks] == [range(0, 2), range(2, 4), range(4, 6)]
    streamed = np.concatenate([c.frames for c in chunks], axis=1)
    assert streamed.shape == called.shape


# diffusers' convention: a list of generators, one per sample --------------------------------------------------------
def test_a_list_of_generators_gives_each_sample_its_own_noise():
    pipe = _pipe(guidance_scale=3.0)
    args = _args(prompt=["a red ball", "a blue cube"], negative_prompt=["blurry", "grainy"], output_type="latent")
    batched = pipe(**args, generator=[_seed(1), _seed(2)]).frames
    for i, seed in enumerate((1, 2)):
        single = pipe(**_args(prompt=args["prompt"][i], negative_prompt=args["negative_prompt"][i],
                              output_type="latent"), generator=_seed(seed)).frames
        torch.testing.assert_close(batched[i:i + 1], single, rtol=0, atol=1e-5)
    streamed = _latents(pipe.stream(**args, num_frames=FRAMES, generator=[_seed(1), _seed(2)],
                                    cache_engines=_engines(pipe, window=21, sink=0, positions="absolute")))
    torch.testing.assert_close(streamed, batched, rtol=0, atol=1e-5)


# 10: a TI2V re-cache commits the image frame as the stream committed it (timestep 0, the image's latents) ------------
def test_a_ti2v_recache_under_the_same_prompt_rebuilds_the_same_cache():
    from diffusers_causal_kv.testing import tiny_wan22_vae

    components = tiny_pipeline_components(tiny_wan(seed=0, in_channels=48, out_channels=48))
    components["vae"] = tiny_wan22_vae(seed=0)
    pipe = CausalWanPipeline(**components, expand_timesteps=True, causal_config=CausalConfig(
        chunk_frames=2, timesteps=TIMESTEPS, context_noise=100.0))
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    engines = {"main": RollingKVCacheEngine(6, positions="relative")}  # re-cached in the chunks it was made in
    stream = pipe.stream(**_args(height=64, width=64, image=image), num_frames=13, generator=_seed(1),
                         cache_engines=engines, output_type="latent")
    next(stream)  # frames 0..1, frame 0 the image
    before = cache_snapshot(_Holder(engines))
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()),
                                                      with_kwargs=True)
    try:
        stream.session.switch_prompt(stream.session.prompts["pos"], mode="recache")
    finally:
        hook.remove()
    # Frame 0 (the image) is re-committed at timestep 0, frame 1 at the commit label.
    tokens = seen[0].shape[1] // 2
    assert len(seen) == 1 and torch.all(seen[0][:, :tokens] == 0) and torch.all(seen[0][:, tokens:] == 100.0)
    assert_same_snapshot(before, cache_snapshot(_Holder(engines)))


class _Holder:
    """An object whose ``kv_cache_engines`` are the given map (what ``cache_snapshot`` reads)."""

    def __init__(self, engines: dict) -> None:
        self.kv_cache_engines = engines


def test_a_config_with_a_list_of_chunk_sizes_streams_as_it_calls():
    """CausalConfig(chunk_frames=[...]) (what a call takes): a stream gives the call's chunks and frames; an endless
    stream continues with the list's last size."""
    pipe = _pipe()
    pipe.causal_config = pipe.causal_config.replace(chunk_frames=[2, 1, 3])
    called = pipe(**_args(), generator=_seed(6), output_type="latent", cache_engines=_engines(pipe)).frames
    chunks = list(pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(6), output_type="latent",
                              cache_engines=_engines(pipe)))
    assert [len(c.latent_frames) for c in chunks] == [2, 1, 3] and pipe.chunk_sizes == [2, 1, 3]
    assert torch.equal(_latents(chunks), called)
    endless = pipe.stream(**_args(), generator=_seed(6), output_type="latent")
    sizes = [len(next(endless).latent_frames) for _ in range(5)]
    assert sizes == [2, 1, 3, 3, 3]
