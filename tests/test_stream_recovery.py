"""Streams after errors, switches from other threads and resumes (issue #25, found by an independent review): each
against an undisturbed stream or the switch asked for."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_sessions import FRAMES, TIMESTEPS, _args, _embeds, _engines, _FailOnce, _frames, _latents, _pipe, _seed

from diffusers_causal_kv import CausalConfig, CausalWanPipeline, RollingKVCacheEngine
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan


def _fails_once(pipe, stream, at: int) -> None:
    """``next(stream)`` with the transformer's ``at``-th forward of it raising (a transient error)."""
    handle = pipe.transformer.register_forward_pre_hook(_FailOnce(at), with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="transient device error"):
            next(stream)
    finally:
        handle.remove()


def _drain(stream):
    got, errors = [], 0
    while True:
        try:
            got.append(next(stream))
        except StopIteration:
            return got, errors
        except RuntimeError:
            errors += 1
            if errors > 5:
                raise


# A: a transient error while decoding a committed chunk loses that chunk
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_error_loses_no_chunk(overlap):
    pipe = _pipe()
    expected = list(pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(7), cache_engines=_engines(pipe),
                                overlap=overlap))
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(7), cache_engines=_engines(pipe),
                         overlap=overlap)
    real, calls = stream._decoder.decode, [0]

    def flaky(latents):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("transient decode error")
        return real(latents)

    stream._decoder.decode = flaky
    got, errors = _drain(stream)
    assert errors == 1
    assert [c.index for c in got] == [0, 1, 2]
    for a, b in zip(got, expected):  # decoded again from the VAE cache as it was before the failed call
        assert torch.equal(a.latents, b.latents)
        # With overlap the CPU decode runs on a worker thread beside the transformer (or, on the retry, alone):
        # intra-op threads split its reductions differently, a last-bit difference (seen: 3e-8).
        np.testing.assert_allclose(a.frames, b.frames, rtol=0, atol=1e-6 if overlap else 0)


# B: a switch asked for (from another thread) while the previous switch is being applied is lost
def test_switch_during_apply_is_not_lost():
    pipe = _pipe()
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(1), cache_engines=_engines(pipe),
                         output_type="latent")
    next(stream)
    stream.switch_prompt("a blue cube")
    real = stream.session.switch_prompt

    def slow_switch(*a, **k):
        # another thread calls switch_prompt while this one is applied (e.g. during a long re-cache)
        t = threading.Thread(target=stream.switch_prompt, args=("a green tree",))
        t.start()
        t.join()
        return real(*a, **k)

    stream.session.switch_prompt = slow_switch
    next(stream)
    stream.session.switch_prompt = real
    next(stream)
    switched = stream.session.prompts["pos"]
    assert torch.equal(switched, _embeds(pipe, "a green tree").to(switched.dtype))


# C: close + resume after a failed chunk in a conditioned stream (V2V) changes the video
def test_resume_after_a_failed_chunk_of_a_v2v_stream_equals_undisturbed():
    pipe = _pipe()
    extra = dict(video=_frames(6), strength=0.7)
    whole = list(pipe.stream(**_args(**extra), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                             output_type="latent"))
    extra = dict(video=_frames(6), strength=0.7)
    first = pipe.stream(**_args(**extra), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                        output_type="latent")
    head = [next(first)]
    _fails_once(pipe, first, at=1)
    first.close()
    rest = list(pipe.stream(**_args(), num_frames=8, resume=first, output_type="latent"))  # chunk 1 only
    assert [c.index for c in head + rest] == [0, 1]
    torch.testing.assert_close(_latents(head + rest), _latents(whole[:2]), rtol=0, atol=0)


# V: a latent stream resumed with decoded frames would decode from the middle of the video: refused
def test_resume_with_frames_after_latent_stream_is_refused():
    pipe = _pipe()
    first = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                        output_type="latent")
    next(first)
    first.close()
    with pytest.raises(ValueError, match="decodes as the closed one did"):
        pipe.stream(**_args(), num_frames=8, resume=first, output_type="np")


# W: resume an overlap stream (it holds a chunk made ahead) without overlap
def test_resume_overlap_stream_without_overlap():
    pipe = _pipe()
    first = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                        overlap=True)
    next(first)
    first.close()
    assert first._ahead is not None
    rest = list(pipe.stream(**_args(), num_frames=4, resume=first, overlap=False))
    assert [c.index for c in rest] == [1, 2]


# Q: a single-string prompt switch on a batched stream
def test_string_switch_on_batched_stream():
    pipe = _pipe()
    stream = pipe.stream(**_args(prompt=["a red ball", "a blue cube"]), num_frames=FRAMES, generator=_seed(1),
                         cache_engines=_engines(pipe), output_type="latent", prompt_schedule={1: "a green tree"})
    chunks = list(stream)
    assert len(chunks) == 3


# F: resume with a new negative prompt (guided) is silently ignored
def test_resume_with_new_negative_prompt():
    pipe = _pipe(guidance_scale=3.0)
    first = pipe.stream(**_args(), negative_prompt="blurry", num_frames=FRAMES, generator=_seed(2),
                        cache_engines=_engines(pipe), output_type="latent")
    next(first)
    first.close()
    resumed = pipe.stream(**_args(prompt="a blue cube"), negative_prompt="grainy", num_frames=8, resume=first,
                          output_type="latent")
    list(resumed)
    assert torch.equal(resumed.session.prompts["neg"], _embeds(pipe, "grainy"))


# R: a re-cache switch that raised part-way, retried, under context_noise_mode="renoise": other noise
@pytest.mark.parametrize("mode", ["renoise", "label"])
def test_recache_switch_retry_with_renoise_equals_undisturbed(mode):
    pipe = _pipe(context_noise=100.0, context_noise_mode=mode)
    common = dict(num_frames=FRAMES, output_type="latent", prompt_schedule={2: "a blue cube"})
    expected = _latents(pipe.stream(**_args(**common), generator=_seed(3), cache_engines=_engines(pipe)))
    stream = pipe.stream(**_args(**common), generator=_seed(3), cache_engines=_engines(pipe))
    got = [next(stream), next(stream)]  # forwards 1..8 (3 steps + commit per chunk)
    _fails_once(pipe, stream, at=2)  # the second commit pass of the re-cache before chunk 2
    got += list(stream)
    assert [c.index for c in got] == [0, 1, 2]
    torch.testing.assert_close(_latents(got), expected, rtol=0, atol=0)


# overlap fault on the chunk made ahead, then close and resume: T2V should equal undisturbed
def test_overlap_fault_then_close_and_resume():
    pipe = _pipe()
    expected = list(pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(7), cache_engines=_engines(pipe)))
    stream = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(7), cache_engines=_engines(pipe),
                         overlap=True)
    _fails_once(pipe, stream, at=5)  # chunk 1, made ahead while chunk 0 is handed out
    got = [next(stream)]  # chunk 0 (ready)
    stream.close()
    got += list(pipe.stream(**_args(), num_frames=16, resume=stream, overlap=True))
    assert [c.index for c in got] == [0, 1, 2]
    torch.testing.assert_close(_latents(got), _latents(expected), rtol=0, atol=0)


# a user's switch pending at a scheduled index is dropped (its negative prompt with it)
def test_user_switch_and_schedule_at_same_chunk():
    pipe = _pipe(guidance_scale=3.0)
    stream = pipe.stream(**_args(), negative_prompt="blurry", num_frames=FRAMES, generator=_seed(1),
                         cache_engines=_engines(pipe), output_type="latent", prompt_schedule={1: "a blue cube"})
    next(stream)
    stream.switch_prompt("a green tree", negative_prompt="grainy")
    list(stream)
    assert torch.equal(stream.session.prompts["neg"], _embeds(pipe, "grainy"))


# two experts (Wan2.2 A14B): retry, re-cache switch, call == stream


def _a14b(**config):
    return CausalWanPipeline(**tiny_pipeline_components(tiny_wan(seed=0)), transformer_2=tiny_wan(seed=1),
                             boundary_ratio=0.7, causal_config=CausalConfig(chunk_frames=2, timesteps=TIMESTEPS,
                                                                            num_frames=FRAMES, **config))


def _a14b_engines():
    return {"transformer": {"main": RollingKVCacheEngine(4, 1, positions="relative")},
            "transformer_2": {"main": RollingKVCacheEngine(4, 1, positions="relative")}}


@pytest.mark.parametrize("at", [3, 6])
def test_a14b_stream_retry_and_switch(at):
    pipe = _a14b(guidance_scale=3.0)
    common = dict(num_frames=FRAMES, negative_prompt="blurry", output_type="latent", guidance_scale_2=2.0,
                  prompt_schedule={2: "a blue cube"})
    expected = _latents(pipe.stream(**_args(**common), generator=_seed(3), cache_engines=_a14b_engines()))
    stream = pipe.stream(**_args(**common), generator=_seed(3), cache_engines=_a14b_engines())
    fault = _FailOnce(at)
    handle = pipe.transformer_2.register_forward_pre_hook(fault, with_kwargs=True)
    try:
        got, errors = _drain(stream)
    finally:
        handle.remove()
    assert fault.fired and errors == 1 and [c.index for c in got] == [0, 1, 2]
    torch.testing.assert_close(_latents(got), expected, rtol=0, atol=0)


def test_a14b_call_equals_stream_with_window():
    pipe = _a14b(window_frames=4, sink_frames=1, positions="relative")
    called = pipe(**_args(), generator=_seed(4), output_type="latent").frames
    streamed = _latents(pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(4), output_type="latent"))
    assert torch.equal(called, streamed)



# a closed stream's schedule entry that falls past the resumed stream's end is silently dropped (item 6 says refuse)
def test_resumed_schedule_entry_past_the_end_is_refused():
    pipe = _pipe()
    first = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(2), cache_engines=_engines(pipe),
                        output_type="latent", prompt_schedule={2: "a blue cube"})
    next(first)
    first.close()
    with pytest.raises(ValueError, match="prompt_schedule"):
        list(pipe.stream(**_args(), num_frames=4, resume=first, output_type="latent"))


def test_control_v2v_retry_without_resume_is_exact():  # passes: the loss is in replan (resume), not in retry
    pipe = _pipe()
    whole = list(pipe.stream(**_args(video=_frames(6), strength=0.7), num_frames=FRAMES, generator=_seed(2),
                             cache_engines=_engines(pipe), output_type="latent"))
    first = pipe.stream(**_args(video=_frames(6), strength=0.7), num_frames=FRAMES, generator=_seed(2),
                        cache_engines=_engines(pipe), output_type="latent")
    fault = _FailOnce(5)
    handle = pipe.transformer.register_forward_pre_hook(fault, with_kwargs=True)
    try:
        got, errors = _drain(first)
    finally:
        handle.remove()
    assert errors == 1
    torch.testing.assert_close(_latents(got), _latents(whole), rtol=0, atol=0)



def test_a_prefill_after_a_failed_chunk_continues_where_the_cache_is():
    """A session's prefill after a chunk failed: the failed chunk is dropped (its draws given back), the clip is
    committed where the cache is, and the next chunk equals the one an undisturbed session makes after that clip."""
    pipe = _pipe()
    clip = torch.randn(1, 16, 2, 4, 4, generator=_seed(9))
    results = []
    for fail in (True, False):
        stream = pipe.stream(**_args(), num_frames=FRAMES, generator=_seed(1), cache_engines=_engines(pipe),
                             output_type="latent")
        next(stream)
        if fail:
            _fails_once(pipe, stream, at=2)
        stream.session.prefill(clip, 2)
        results.append(next(stream))
        assert results[-1].latent_frames == range(4, 6)
    assert torch.equal(results[0].latents, results[1].latents)
