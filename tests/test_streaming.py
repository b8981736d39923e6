"""Prefill and re-cache on a rolling engine: against full-sequence stock forwards with the matching masks, and
recache against clearing the tag and prefilling the same frames; StreamingRollout end to end."""

import pytest
import torch
from helpers import cache_snapshot, conditioning, forward, masked_full_forward, tiny_wan, window_mask

from diffusers_causal_kv import CausalWanAttnProcessor, RollingKVCacheEngine, VanillaKVCacheEngine, causal_rollout
from diffusers_causal_kv.refill import prefill, recache, recache_schedule
from diffusers_causal_kv.streaming import StreamingRollout

H = W = 4
FRAME_TOKENS = 4


def _install(model, engine):
    model.kv_cache_engines = {"main": engine}
    model.set_attn_processor(CausalWanAttnProcessor())
    return engine


def _clip(frames, batch=1, seed=0):
    return torch.randn(batch, 16, frames, H, W, generator=torch.Generator().manual_seed(seed))


def _reference_chunk(model, frames, chunks, text, x, t, window, sink, hidden=()):
    """Stock forward over ``[frames | x]`` with the window mask of ``chunks`` (x the last chunk) at timestep 0 for
    the committed frames; the frames in ``hidden`` are seen by nobody but themselves (evicted frames)."""
    mask = window_mask(chunks, FRAME_TOKENS, window, sink)
    tokens = torch.arange(mask.shape[0]) // FRAME_TOKENS
    gone = torch.isin(tokens, torch.tensor(list(hidden), dtype=torch.long))
    mask = (mask & ~gone[None, :]) | (gone[:, None] & (tokens[:, None] == tokens[None, :]))
    committed = frames.shape[2]
    per_token = torch.cat([torch.zeros(1, committed * FRAME_TOKENS), t[:, None].expand(-1, x.shape[2] * FRAME_TOKENS)],
                          dim=1)
    with torch.no_grad():
        out = masked_full_forward(model, torch.cat([frames, x], dim=2), per_token, text, None, mask)
    return out[:, :, committed:]


def test_recache_schedule():
    assert recache_schedule(7, 3) == [1, 3, 3]
    assert recache_schedule(6, 3) == [3, 3]
    assert recache_schedule(2, 3) == [2]
    assert recache_schedule(5, 2) == [1, 2, 2]


@pytest.mark.parametrize("engine", ["rolling", "vanilla"])
def test_prefill_continues_a_clip(engine):
    model = tiny_wan()
    window, sink = (5, 1) if engine == "rolling" else (64, 0)
    _install(model, RollingKVCacheEngine(window, sink) if engine == "rolling" else VanillaKVCacheEngine())
    text, _ = conditioning(model, batch=1)
    clip = _clip(7)
    assert prefill(model, clip, text, chunk_frames=2) == 7  # chunks [3, 2, 2]
    x, t = _clip(2, seed=1), torch.full((1,), 600.0)
    out = forward(model, x, t, text, start_frame=7)
    ref = _reference_chunk(model, clip, [3, 2, 2, 2], text, x, t, window, sink)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_prefill_errors_leave_the_cache_unchanged():
    model = tiny_wan()
    _install(model, VanillaKVCacheEngine())
    text, _ = conditioning(model, batch=1)
    prefill(model, _clip(2), text)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=r"prefill\(start_frame=1\).*continues at frame 2"):
        prefill(model, _clip(2), text, start_frame=1)
    with pytest.raises(ValueError, match=r"prefill\(start_frame=5\).*skip forward on a RollingKVCacheEngine"):
        prefill(model, _clip(2), text, start_frame=5)
    assert cache_snapshot(model).keys() == before.keys()
    assert model.kv_cache_engines["main"].num_frames("pos") == 2


def _prefilled(positions, window=5, sink=1, frames=9, chunk=2, seed=0):
    model = tiny_wan(seed=seed)
    engine = _install(model, RollingKVCacheEngine(window, sink, positions=positions))
    text, _ = conditioning(model, batch=1)
    clip = _clip(frames)
    prefill(model, clip, text, chunk_frames=chunk)
    window_latents = [(r.start, clip[:, :, r.start:r.stop]) for r in engine.held_frames("pos")]
    return model, engine, window_latents


def _assert_close_caches(a, b, atol=1e-6):
    (meta_a, bytes_a, tensors_a), (meta_b, bytes_b, tensors_b) = a["main"], b["main"]
    assert meta_a == meta_b and bytes_a == bytes_b and len(tensors_a) == len(tensors_b)
    for x, y in zip(tensors_a, tensors_b):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("positions", ["absolute", "relative"])
@pytest.mark.parametrize("sink", [0, 1], ids=["no-sink", "sink1"])
def test_recache_equals_clearing_and_prefilling_with_the_new_prompt(positions, sink):
    model, engine, window = _prefilled(positions, sink=sink)
    held = engine.held_frames("pos")
    assert held == ([range(0, 1)] if sink else []) + [range(5 + sink, 9)]
    new_text, _ = conditioning(model, batch=1, seed=21)
    before = cache_snapshot(model)
    recache(model, window, new_text, chunk_frames=2)
    after = cache_snapshot(model)
    assert engine.held_frames("pos") == held and engine.next_frame("pos") == 9

    engine.clear("pos")
    for start, latents in window:
        prefill(model, latents, new_text, start_frame=start, chunk_frames=recache_schedule(latents.shape[2], 2))
    _assert_close_caches(after, cache_snapshot(model))
    # The new prompt changed the K/V (the cross entries and the recomputed self entries).
    assert not all(torch.allclose(x, y) for x, y in zip(before["main"][2], after["main"][2]))


def test_recache_that_fails_part_way_leaves_the_tag_as_it_was():
    """The new tag is built in scratch engines: an error in its second prefill forward leaves the old tag (frames,
    cross entries, next frame, memory) bitwise as it was, and the same recache then succeeds."""
    model, engine, window = _prefilled("absolute")
    new_text, _ = conditioning(model, batch=1, seed=21)
    before = cache_snapshot(model)
    calls = []

    def fail_on_second_forward(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")

    handle = model.blocks[1].register_forward_pre_hook(fail_on_second_forward)
    with pytest.raises(RuntimeError, match="injected fault"):
        recache(model, window, new_text, chunk_frames=2)
    handle.remove()
    _assert_close_caches(before, cache_snapshot(model), atol=0)
    assert engine.held_frames("pos") == [range(0, 1), range(6, 9)] and engine.next_frame("pos") == 9
    recache(model, window, new_text, chunk_frames=2)
    assert engine.held_frames("pos") == [range(0, 1), range(6, 9)] and engine.next_frame("pos") == 9
    assert engine.memory_bytes() == before["main"][1]


def test_recache_of_a_window_holding_nothing_keeps_the_next_frame():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(1))  # a chunk sees only itself: nothing is ever held
    text, _ = conditioning(model, batch=1)
    prefill(model, _clip(3), text, chunk_frames=1)
    assert engine.held_frames("pos") == [] and engine.next_frame("pos") == 3
    new_text, _ = conditioning(model, batch=1, seed=21)
    recache(model, [], new_text)
    assert engine.next_frame("pos") == 3 and not engine.is_cross_init("pos")
    forward(model, _clip(1), torch.zeros(1), new_text, start_frame=3, store_kv=True)  # takes the new prompt
    assert engine.is_cross_init("pos")


def test_next_chunk_after_recache_matches_a_full_forward():
    """After the switch the window holds the sink and the recent frames recomputed under the new prompt at their
    own positions; the evicted frames in between are seen by nobody."""
    model, engine, window = _prefilled("absolute")  # window 5, sink 1: holds frames 0 and 6..8
    new_text, _ = conditioning(model, batch=1, seed=21)
    recache(model, window, new_text, chunk_frames=2)
    x, t = _clip(2, seed=3), torch.full((1,), 500.0)
    out = forward(model, x, t, new_text, start_frame=9)
    clip = _clip(9)
    filler = clip.clone()  # the evicted frames' values do not matter: nobody attends to them
    filler[:, :, 1:6] = 0
    # Re-cache chunks: the sink [1], then the recent frames [1, 2] (recache_schedule(3, 2)); then the new chunk.
    ref = _reference_chunk(model, filler, [1, 5, 1, 2, 2], new_text, x, t, window=5, sink=1, hidden=range(1, 6))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_recache_errors():
    model, engine, window = _prefilled("absolute")
    new_text, _ = conditioning(model, batch=1, seed=21)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=r"holds frames \[0..0, 6..8\] but the window latents cover \[0..0, 5..8\]"):
        recache(model, [window[0], (5, _clip(4))], new_text)
    _assert_close_caches(before, cache_snapshot(model), atol=0)
    vanilla = tiny_wan()
    _install(vanilla, VanillaKVCacheEngine())
    prefill(vanilla, _clip(2), new_text)
    with pytest.raises(TypeError, match="refills the window of a RollingKVCacheEngine"):
        recache(vanilla, [(0, _clip(2))], new_text)


@pytest.mark.parametrize("kind", ["vace", "i2v"])
def test_streaming_rollout_with_per_frame_inputs_equals_causal_rollout(kind):
    """I2V / VACE streams take their per-frame inputs with each generate() call; chunk by chunk they give
    causal_rollout's latents over the whole video."""
    from helpers import tiny_vace

    model = tiny_vace() if kind == "vace" else tiny_wan(i2v=True)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, image = conditioning(model, batch=1)
    frames = 4
    name, channels = (("control_latents", model.config.vace_in_channels) if kind == "vace"
                      else ("condition_latents", 20))
    per_frame = torch.randn(1, channels, frames, 4, 4, generator=torch.Generator().manual_seed(4))
    noise = torch.randn(1, 16, frames, 4, 4, generator=torch.Generator().manual_seed(5))
    extra = {"image_embeds": image} if kind == "i2v" else {}
    expected = causal_rollout(model, noise, text, chunk_frames=2, timesteps=(1000, 500), progress=False,
                              generator=torch.Generator().manual_seed(6), **{name: per_frame}, **extra).latents
    stream = StreamingRollout(model, text, chunk_frames=2, timesteps=(1000, 500),
                              generator=torch.Generator().manual_seed(6), **extra)
    parts = [stream.generate(noise[:, :, k:k + 2], **{name: per_frame[:, :, k:k + 2]}).latents for k in (0, 2)]
    assert torch.equal(torch.cat(parts, dim=2), expected)


def test_streaming_rollout_errors():
    with pytest.raises(ValueError, match="needs negative_prompt_embeds"):
        StreamingRollout(tiny_wan(), torch.zeros(1, 12, 32), guidance_scale=3.0)


def test_streaming_rollout_continues_a_prefilled_clip():
    model = tiny_wan()
    _install(model, RollingKVCacheEngine(5, sink_frames=1))
    text, _ = conditioning(model, batch=1)
    clip, noise = _clip(7), _clip(4, seed=2)
    stream = StreamingRollout(model, text, chunk_frames=2, timesteps=[1000])
    stream.prefill(clip)  # commit chunks [3, 2, 2]
    assert stream.next_frame == 7
    latents = stream.generate(noise).latents
    assert stream.next_frame == 11
    # One step at sigma 1 per chunk: x0 = noise - flow, against the window-masked full forward.
    frames, chunks = clip, [3, 2, 2]
    for k in range(2):
        x = noise[:, :, 2 * k:2 * k + 2]
        flow = _reference_chunk(model, frames, chunks + [2], text, x, torch.full((1,), 1000.0), 5, 1)
        torch.testing.assert_close(latents[:, :, 2 * k:2 * k + 2], x - flow, rtol=0, atol=1e-5)
        frames, chunks = torch.cat([frames, x - flow], dim=2), chunks + [2]
    held = [range(0, 1), range(8, 11)]
    assert [(s, t.shape[2]) for s, t in stream.window()] == [(r.start, len(r)) for r in held]
    assert torch.equal(stream.window()[0][1], clip[:, :, :1]) and torch.equal(stream.window()[1][1], latents[:, :, 1:])


def test_streaming_rollout_switches_prompts_with_flat_memory():
    model = tiny_wan(rope_max_seq_len=4)
    engine = _install(model, RollingKVCacheEngine(4, sink_frames=1, positions="relative"))
    text, _ = conditioning(model, batch=1)
    negative, _ = conditioning(model, batch=1, seed=4)
    new_text, _ = conditioning(model, batch=1, seed=21)
    stream = StreamingRollout(model, text, negative_prompt_embeds=negative, guidance_scale=2.0, chunk_frames=1,
                              timesteps=[1000], generator=torch.Generator().manual_seed(0))
    memory, engine_memory = [], []
    for i in range(8):  # twice past the 4-position RoPE table
        if i == 4:
            stream.switch_prompt(new_text)
        latents = stream.generate(_clip(1, seed=10 + i)).latents
        assert torch.isfinite(latents).all()
        memory.append(stream.memory_bytes())
        engine_memory.append(engine.memory_bytes())
    assert stream.next_frame == 8 and engine.num_frames("neg") == 8
    assert len(set(engine_memory)) == 1 and len(set(memory[2:])) == 1  # the kept latents fill with the window
    assert engine.held_frames("pos") == [range(0, 1), range(6, 8)]
    # The switch re-cached "pos" under the new prompt; "neg" kept its own.
    with pytest.raises(ValueError, match="cross-attention K/V built from other conditioning"):
        forward(model, _clip(1), torch.zeros(1), text, start_frame=8, cache_tag="pos")
    forward(model, _clip(1), torch.zeros(1), negative, start_frame=8, cache_tag="neg")


def test_continue_cache_on_an_empty_cache_equals_a_fresh_rollout():
    from diffusers_causal_kv import causal_rollout

    model = tiny_wan()
    _install(model, RollingKVCacheEngine(4))
    text, _ = conditioning(model, batch=1)
    noise = _clip(6)
    fresh = causal_rollout(model, noise, text, chunk_frames=2, timesteps=[1000, 500],
                           generator=torch.Generator().manual_seed(1), progress=False).latents
    stream = StreamingRollout(model, text, chunk_frames=2, timesteps=[1000, 500],
                              generator=torch.Generator().manual_seed(1))
    first = stream.generate(noise[:, :, :2]).latents
    rest = stream.generate(noise[:, :, 2:]).latents
    torch.testing.assert_close(torch.cat([first, rest], dim=2), fresh, rtol=0, atol=1e-6)


def test_prefill_whose_first_chunk_fails_undoes_its_skip():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(4, sink_frames=1))
    text, _ = conditioning(model, batch=1)
    other, _ = conditioning(model, batch=1, seed=7)
    prefill(model, _clip(3), text, chunk_frames=1)
    before = cache_snapshot(model)
    for latents, prompt, chunk, match in [(_clip(1), other, 1, "other conditioning"),
                                          (_clip(4), text, 4, "does not fit"),
                                          (_clip(1, batch=2), text.expand(2, -1, -1), 1, "batch size 1")]:
        with pytest.raises(ValueError, match=match):
            prefill(model, latents, prompt, start_frame=5, chunk_frames=chunk)
        _assert_close_caches(before, cache_snapshot(model), atol=0)
        assert engine.next_frame("pos") == 3 and engine.held_frames("pos") == [range(0, 1), range(1, 3)]
    prefill(model, _clip(1), text, start_frame=5)  # the skip itself still works
    assert engine.held_frames("pos") == [range(0, 1), range(5, 6)]


def _stream(model, **kwargs):
    text, _ = conditioning(model, batch=1)
    return StreamingRollout(model, text, chunk_frames=1, timesteps=(1000,), **kwargs)


def test_switch_prompt_is_all_or_nothing():
    model = tiny_wan()
    _install(model, RollingKVCacheEngine(4, sink_frames=1))
    neg, _ = conditioning(model, batch=1, seed=3)
    stream = _stream(model, negative_prompt_embeds=neg, guidance_scale=3.0)
    stream.generate(_clip(3))
    before, prompts = cache_snapshot(model), dict(stream.prompts)
    new, _ = conditioning(model, batch=1, seed=5)
    with pytest.raises(ValueError, match="encoder_hidden_states must be"):
        stream.switch_prompt(new, torch.randn(1, 12, 7))  # a malformed negative prompt: "pos" must not switch alone
    _assert_close_caches(before, cache_snapshot(model), atol=0)
    assert stream.prompts == prompts


def test_interrupted_generate_keeps_the_chunks_it_committed():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(4, sink_frames=1))
    stream = _stream(model)
    stream.generate(_clip(1))
    calls = []

    def interrupt_third_forward(module, args):
        calls.append(1)
        if len(calls) == 3:  # chunk 2's denoising pass, after chunk 1's denoising and commit passes
            raise KeyboardInterrupt

    handle = model.blocks[0].register_forward_pre_hook(interrupt_third_forward)
    with pytest.raises(KeyboardInterrupt):
        stream.generate(_clip(3))
    handle.remove()
    assert engine.next_frame("pos") == stream.next_frame == 2
    assert [(start, t.shape[2]) for start, t in stream.window()] == [(0, 1), (1, 1)]
    assert stream.generate(_clip(2)).latents.shape[2] == 2  # the stream goes on
    assert engine.next_frame("pos") == 4


def test_a_commit_failing_on_one_tag_commits_no_tag():
    """CFG commits a chunk on "pos" and "neg" together: an out-of-memory on the "neg" allocation leaves both tags
    (and the stream) at the previous chunk, and the stream goes on."""
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(5, 1))
    neg, _ = conditioning(model, batch=1, seed=5)
    stream = _stream(model, negative_prompt_embeds=neg, guidance_scale=3.0)
    stream.generate(_clip(2))
    before = cache_snapshot(model)
    prepare = RollingKVCacheEngine.prepare_commit

    def out_of_memory_on_neg(self, p, staged):
        if p.cache_tag == "neg":
            raise torch.OutOfMemoryError("simulated")
        return prepare(self, p, staged)

    RollingKVCacheEngine.prepare_commit = out_of_memory_on_neg
    try:
        with pytest.raises(torch.OutOfMemoryError):
            stream.generate(_clip(1))
    finally:
        RollingKVCacheEngine.prepare_commit = prepare
    _assert_close_caches(before, cache_snapshot(model), atol=0)
    assert engine.num_frames("pos") == engine.num_frames("neg") == stream.next_frame == 2
    stream.generate(_clip(1))
    stream.switch_prompt(neg, neg)
    assert engine.num_frames("pos") == engine.num_frames("neg") == 3


def test_generate_checks_the_whole_request_first():
    model = tiny_wan(rope_max_seq_len=4)
    engine = _install(model, RollingKVCacheEngine(5, 1))
    stream = _stream(model)
    with pytest.raises(ValueError, match=r"covers latent frames 0\.\.5 but the RoPE table has 4"):
        stream.generate(_clip(6))
    assert engine.num_frames("pos") == stream.next_frame == 0 and stream.window() == []
