"""CausalWanPipeline.stream(): streamed frames equal the pipeline call's (T2V, I2V, VACE), prompt switches,
video-to-video, closing and resuming, flat memory over a long stream."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from diffusers_causal_kv import CausalConfig, CausalWanPipeline, RollingKVCacheEngine, StreamingRollout
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_vace, tiny_wan

H = W = 32
FRAMES = 21  # 6 latent frames
TIMESTEPS = (1000, 600, 300)
SEQ = 16


def _pipe(transformer=None) -> CausalWanPipeline:
    return CausalWanPipeline(**tiny_pipeline_components(transformer),
                             causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS, num_frames=FRAMES))


def _engines(pipe):
    from diffusers_causal_kv.model import topology

    return {b: RollingKVCacheEngine(4, 1, positions="relative") for b in topology(pipe.transformer).branches}


def _args(**kwargs):
    args = dict(prompt="a red ball", height=H, width=W, max_sequence_length=SEQ)
    args.update(kwargs)
    return args


def _frames(seed=0, count=FRAMES):
    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)) for _ in range(count)]


@pytest.mark.parametrize("kind", ["t2v", "i2v", "vace"])
def test_streamed_frames_equal_the_pipeline_call(kind):
    transformer = {"t2v": tiny_wan, "i2v": lambda: tiny_wan(i2v=True),
                   "vace": lambda: tiny_vace(vace_in_channels=96)}[kind]()
    pipe = _pipe(transformer)
    extra = {}
    if kind == "i2v":
        extra = dict(image=_frames(1, 1)[0], image_embeds=torch.randn(1, 4, 8), max_sequence_length=512)
    called = dict(extra)
    streamed = dict(extra)
    if kind == "vace":
        video = _frames(2)
        mask = [PIL.Image.fromarray(np.full((H, W), 255 * (i % 2), dtype=np.uint8)) for i in range(FRAMES)]
        called.update(video=video, mask=mask)
        streamed.update(control_video=iter(video), control_mask=iter(mask))
    expected = pipe(**_args(**called), num_frames=FRAMES, generator=torch.Generator().manual_seed(4),
                    cache_engines=_engines(pipe)).frames
    chunks = list(pipe.stream(**_args(**streamed), num_frames=FRAMES, generator=torch.Generator().manual_seed(4),
                              cache_engines=_engines(pipe)))
    assert [len(c.latent_frames) for c in chunks] == [2, 2, 2]
    assert [c.video_frames for c in chunks] == [range(0, 5), range(5, 13), range(13, 21)]
    frames = np.concatenate([c.frames for c in chunks], axis=1)
    np.testing.assert_array_equal(frames, expected)
    assert all(c.seconds > 0 and c.time_to_frames >= c.seconds for c in chunks)


def test_latent_stream_equals_the_pipeline_latents_and_uses_relative_rolling_engines_by_default():
    pipe = _pipe()
    expected = pipe(**_args(), generator=torch.Generator().manual_seed(1), output_type="latent",
                    cache_engines=_engines(pipe)).frames
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(1),
                         output_type="latent", window_frames=4, sink_frames=1)
    chunks = list(stream)
    assert chunks[0].frames is None
    assert torch.equal(torch.cat([c.latents for c in chunks], dim=2), expected)
    engine = stream.session.engine
    assert isinstance(engine, RollingKVCacheEngine) and engine.reindexes_positions


def test_unbounded_stream_runs_past_the_rope_table_and_closes_consistently():
    pipe = _pipe()
    stream = pipe.stream(**_args(), chunk_frames=4, timesteps=[1000], output_type="latent", window_frames=6)
    for chunk in stream:
        if chunk.index == 9:  # 40 latent frames: past the tiny model's 32-position RoPE table
            stream.close()
    assert chunk.latent_frames == range(36, 40) and stream.session.next_frame == 40
    assert list(stream) == []


def test_closing_after_k_chunks_leaves_k_chunks_and_resume_continues_them():
    pipe = _pipe()
    whole = list(pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(2),
                             cache_engines=_engines(pipe)))
    generator = torch.Generator().manual_seed(2)
    first = pipe.stream(**_args(), num_frames=FRAMES, generator=generator, cache_engines=_engines(pipe))
    head = [next(first), next(first)]
    first.close()
    assert first.session.next_frame == 4 and first.session.engine.num_frames("pos") <= 4
    with pytest.raises(ValueError, match="resume= takes a closed stream"):
        pipe.stream(**_args(), resume=pipe.stream(**_args()))
    rest = list(pipe.stream(**_args(), num_frames=8, generator=generator, resume=first))
    assert [c.index for c in rest] == [2] and rest[0].latent_frames == range(4, 6)
    np.testing.assert_array_equal(np.concatenate([c.frames for c in head + rest], axis=1),
                                  np.concatenate([c.frames for c in whole], axis=1))


@pytest.mark.parametrize("mode", ["recache", "cross"])
def test_prompt_schedule_switches_like_the_streaming_rollout(mode):
    """A schedule entry switches before its chunk, as StreamingRollout.switch_prompt does (re-cache: the tag cleared
    and the window prefilled under the new prompt)."""
    pipe = _pipe()
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(3),
                         cache_engines=_engines(pipe), output_type="latent", prompt_schedule={2: "a blue cube"},
                         prompt_switch=mode)
    latents = torch.cat([c.latents for c in stream], dim=2)

    with torch.no_grad():  # as in the stream: the text encoder's kernels differ in the last bit with autograd on
        old, _ = pipe.encode_prompt("a red ball", do_classifier_free_guidance=False, max_sequence_length=SEQ)
        new, _ = pipe.encode_prompt("a blue cube", do_classifier_free_guidance=False, max_sequence_length=SEQ)
    generator = torch.Generator().manual_seed(3)
    rollout = StreamingRollout(pipe.transformer, old, chunk_frames=2, timesteps=TIMESTEPS,
                               cache_engines=_engines(pipe), generator=generator)
    parts = []
    for k in range(3):
        if k == 2:
            rollout.switch_prompt(new, mode=mode)
        parts.append(rollout.generate(torch.randn(1, 16, 2, 4, 4, generator=generator)).latents)
    assert torch.equal(latents, torch.cat(parts, dim=2))
    unswitched = torch.cat([c.latents for c in pipe.stream(
        **_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(3), cache_engines=_engines(pipe),
        output_type="latent")], dim=2)
    assert torch.equal(latents[:, :, :4], unswitched[:, :, :4]) and not torch.equal(latents, unswitched)


def test_switch_prompt_while_streaming_takes_effect_at_the_next_chunk():
    pipe = _pipe()
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(3),
                         cache_engines=_engines(pipe), output_type="latent")
    scheduled = pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(3),
                            cache_engines=_engines(pipe), output_type="latent", prompt_schedule={1: "a blue cube"})
    got = [next(stream)]
    stream.switch_prompt("a blue cube")
    got += list(stream)
    assert torch.equal(torch.cat([c.latents for c in got], 2), torch.cat([c.latents for c in scheduled], 2))
    with pytest.raises(ValueError, match="prompt switch mode must be"):
        stream.switch_prompt("x", mode="swap")


def test_video_to_video_strength_one_is_text_to_video_and_lower_strength_noises_the_input():
    pipe = _pipe()
    t2v = [c.latents for c in pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(5),
                                          cache_engines=_engines(pipe), output_type="latent")]
    v2v = [c.latents for c in pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(5),
                                          cache_engines=_engines(pipe), output_type="latent",
                                          video=iter(_frames(6)), strength=1.0)]
    assert torch.equal(torch.cat(t2v, 2), torch.cat(v2v, 2))

    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["hidden_states"].clone()),
                                                      with_kwargs=True)
    try:
        stream = pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(5),
                             cache_engines=_engines(pipe), output_type="latent", video=iter(_frames(6)),
                             strength=0.7)
        next(stream)
    finally:
        hook.remove()
    from diffusers_causal_kv import StreamingVAEEncoder
    from diffusers_causal_kv.session import shifted_sigmas

    pixels = pipe.video_processor.preprocess_video(_frames(6)[:5], H, W)
    z = StreamingVAEEncoder(pipe.vae).encode(pixels)
    noise = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(5))
    sigma = float(shifted_sigmas([600.0], 5.0)[0])  # 600 is the first timestep at or below 0.7 * 1000
    assert torch.equal(seen[0], (1 - sigma) * z + sigma * noise)


def test_stream_errors():
    pipe = _pipe()
    with pytest.raises(ValueError, match="strength must lie in"):
        pipe.stream(**_args(), video=[], strength=0.0)
    with pytest.raises(ValueError, match="keeps none of the timesteps"):
        pipe.stream(**_args(), video=[], strength=0.1)
    stream = pipe.stream(**_args(), num_frames=FRAMES, video=iter(_frames(0, 3)), output_type="latent")
    with pytest.raises(ValueError, match="ran out after 3 frames"):
        next(stream)


@pytest.mark.slow
def test_long_stream_with_two_prompt_switches_keeps_memory_flat():
    pipe = _pipe()
    stream = pipe.stream(**_args(height=16, width=16), chunk_frames=1, timesteps=[1000], window_frames=4,
                         sink_frames=1, prompt_schedule={60: "a blue cube", 130: "a green cone"})
    memory = []
    for chunk in stream:
        memory.append((stream.session.memory_bytes(), stream._decoder.memory_bytes()))
        if chunk.index == 199:
            stream.close()
    assert len(memory) == 200
    assert len(set(memory[10:])) == 1, sorted(set(memory[10:]))


def test_overlap_gives_the_same_frames_with_one_chunk_of_lookahead():
    """overlap=True (decode chunk k while chunk k + 1 is made) runs in the same order on CPU: the same frames; closing
    after chunk k leaves the chunk made ahead committed, and resume hands it out first."""
    pipe = _pipe()
    plain = list(pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(7),
                             cache_engines=_engines(pipe), overlap=False))
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=torch.Generator().manual_seed(7),
                         cache_engines=_engines(pipe), overlap=True)
    first = next(stream)
    assert stream.session.next_frame == 4  # chunk 1 was made while chunk 0 was decoded
    stream.close()
    rest = list(pipe.stream(**_args(), num_frames=8, resume=stream, overlap=True))
    assert [c.index for c in [first, *rest]] == [0, 1, 2]
    assert all(torch.equal(a.latents, b.latents) for a, b in zip([first, *rest], plain))
    # On a CPU the overlapped decode runs on a worker thread: its reductions may split differently (last bit).
    np.testing.assert_allclose(np.concatenate([c.frames for c in [first, *rest]], axis=1),
                               np.concatenate([c.frames for c in plain], axis=1), rtol=0, atol=1e-6)
