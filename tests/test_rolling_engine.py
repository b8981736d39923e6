"""RollingKVCacheEngine: a sliding window with attention sinks, checked against a full-sequence stock forward with
the matching window-plus-sink mask; relative positions against absolute ones; bounded memory; errors."""

import pytest
import torch
from helpers import (
    assert_same_snapshot,
    cache_snapshot,
    conditioning,
    forward,
    masked_full_forward,
    tiny_wan,
    window_mask,
)

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    VanillaKVCacheEngine,
    causal_rollout,
    self_forcing_rollout,
)

H = W = 4  # 2x2 = 4 tokens per latent frame with patch (1, 2, 2)
FRAME_TOKENS = 4


def _install(model, engine):
    model.kv_cache_engines = {"main": engine}
    model.set_attn_processor(CausalWanAttnProcessor())
    return engine


def _rollout(model, chunks, steps=(700.0,), batch=1, seed=5):
    """Cached forwards over ``chunks``: ``steps`` denoising passes then a commit per chunk. Yields, per denoising
    pass, (chunk index, output, the committed inputs before it, the input, its timestep)."""
    text, _ = conditioning(model, batch=batch)
    g = torch.Generator().manual_seed(seed)
    committed, start = [], 0
    for k, size in enumerate(chunks):
        for step in steps:
            x = torch.randn(batch, 16, size, H, W, generator=g)
            t = torch.full((batch,), step)
            out = forward(model, x, t, text, start_frame=start)
            yield k, out, list(committed), x, t
        clean = torch.randn(batch, 16, size, H, W, generator=g)
        forward(model, clean, torch.zeros(batch), text, start_frame=start, store_kv=True)
        committed.append(clean)
        start += size


def _window_reference(model, chunks, committed, x, t, window, sink):
    text, _ = conditioning(model, batch=x.shape[0])
    seen = chunks[: len(committed) + 1]
    per_token = torch.cat([torch.zeros(x.shape[0], sum(seen[:-1]) * FRAME_TOKENS),
                           t[:, None].expand(-1, seen[-1] * FRAME_TOKENS)], dim=1)
    with torch.no_grad():
        out = masked_full_forward(model, torch.cat(committed + [x], dim=2), per_token, text, None,
                                  window_mask(seen, FRAME_TOKENS, window, sink))
    return out[:, :, sum(seen[:-1]):]


@pytest.mark.parametrize(
    "window, sink, chunks",
    [(4, 0, [2] * 4), (5, 0, [2] * 4), (5, 2, [1] * 6), (6, 1, [3, 2, 3, 2]), (4, 1, [3, 3, 3])],
    ids=["w4-chunk2", "w5-chunk2-partial", "w5-sink2-chunk1", "w6-sink1-uneven", "w4-sink1-chunk3"],
)
def test_absolute_mode_matches_window_mask_full_forward(window, sink, chunks):
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(window, sink))
    memory = []
    for k, out, committed, x, t in _rollout(model, chunks):
        ref = _window_reference(model, chunks, committed, x, t, window, sink)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5, msg=f"chunk {k}")
        if k:
            memory.append(engine.memory_bytes())
    assert len(set(memory)) == 1  # allocated once by the first commit
    for entry in engine._self_kv.values():
        assert entry["pos"].keys.shape[1] <= window * FRAME_TOKENS
    assert engine.num_frames("pos") == sum(chunks)


def test_the_window_matters():
    """A window mask differs from the block-causal one, so the equivalence above is not vacuous."""
    model = tiny_wan()
    _install(model, RollingKVCacheEngine(3))
    vanilla = tiny_wan()
    _install(vanilla, VanillaKVCacheEngine())
    outs = [[out for _, out, *_ in _rollout(m, [1] * 4)] for m in (model, vanilla)]
    assert (outs[0][-1] - outs[1][-1]).abs().max() > 1e-3


@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_equals_vanilla_before_the_window_fills(positions):
    chunks = [2, 1, 2, 3]  # 8 frames: every chunk ends inside the 8-frame window
    rolling, vanilla = tiny_wan(), tiny_wan()
    _install(rolling, RollingKVCacheEngine(8, sink_frames=2, positions=positions))
    _install(vanilla, VanillaKVCacheEngine())
    for (_, a, *_), (_, b, *_) in zip(_rollout(rolling, chunks, batch=2), _rollout(vanilla, chunks, batch=2)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("window, chunks", [(4, [1] * 10), (5, [2] * 6), (6, [3, 2, 2, 3, 2])])
def test_relative_without_sink_equals_absolute(window, chunks):
    absolute, relative = tiny_wan(), tiny_wan()
    _install(absolute, RollingKVCacheEngine(window))
    _install(relative, RollingKVCacheEngine(window, positions="relative"))
    for (k, a, *_), (_, b, *_) in zip(_rollout(absolute, chunks), _rollout(relative, chunks)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"chunk {k}")


def test_relative_mode_runs_ten_times_past_the_rope_table():
    max_len = 6
    model = tiny_wan(rope_max_seq_len=max_len)
    engine = _install(model, RollingKVCacheEngine(4, sink_frames=1, positions="relative"))
    text, _ = conditioning(model, batch=1)
    frames = 10 * max_len + 3
    memory = []
    noise = torch.randn(1, 16, frames, H, W, generator=torch.Generator().manual_seed(0))
    # One denoising step and one commit per 1-frame chunk, through the plain CausalContext API.
    for start in range(frames):
        out = forward(model, noise[:, :, start:start + 1], torch.full((1,), 900.0), text, start_frame=start)
        assert torch.isfinite(out).all()
        forward(model, out, torch.zeros(1), text, start_frame=start, store_kv=True)
        memory.append(engine.memory_bytes())
    assert engine.num_frames("pos") == frames
    assert len(set(memory)) == 1
    assert engine.held_frames("pos") == [range(0, 1), range(frames - 2, frames)]
    # The absolute mode refuses the same rollout where the table ends, before any work.
    absolute = tiny_wan(rope_max_seq_len=max_len)
    _install(absolute, RollingKVCacheEngine(4, sink_frames=1))
    for start in range(max_len):
        forward(absolute, noise[:, :, start:start + 1], torch.zeros(1), text, start_frame=start, store_kv=True)
    with pytest.raises(ValueError, match="RoPE table has 6 positions"):
        forward(absolute, noise[:, :, :1], torch.zeros(1), text, start_frame=max_len)


def test_relative_rollout_helper_past_the_rope_table():
    model = tiny_wan(rope_max_seq_len=4)
    engine = _install(model, RollingKVCacheEngine(3, positions="relative"))
    text, _ = conditioning(model, batch=1)
    noise = torch.randn(1, 16, 12, H, W, generator=torch.Generator().manual_seed(0))
    result = causal_rollout(model, noise, text, chunk_frames=2, timesteps=[1000, 500], progress=False)
    assert torch.isfinite(result.latents).all() and engine.num_frames("pos") == 12


def test_constructor_errors():
    with pytest.raises(ValueError, match="sink_frames=4 leaves no room in window_frames=4"):
        RollingKVCacheEngine(4, sink_frames=4)
    with pytest.raises(ValueError, match="window_frames must be positive"):
        RollingKVCacheEngine(0)
    with pytest.raises(ValueError, match="sink_frames must be >= 0"):
        RollingKVCacheEngine(3, sink_frames=-1)
    with pytest.raises(TypeError, match="window_frames must be an int"):
        RollingKVCacheEngine(2.5)
    with pytest.raises(ValueError, match="positions must be one of"):
        RollingKVCacheEngine(3, positions="rotary")


def test_bad_chunks_raise_at_the_forward_and_leave_the_cache_unchanged():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(5, sink_frames=2))
    text, _ = conditioning(model, batch=1)
    forward(model, torch.randn(1, 16, 2, H, W), torch.zeros(1), text, start_frame=0, store_kv=True)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match="chunk of 4 latent frames does not fit .* at most 3 frames"):
        forward(model, torch.randn(1, 16, 4, H, W), torch.zeros(1), text, start_frame=2, store_kv=True)
    with pytest.raises(ValueError, match="chunk of 6 latent frames"):
        forward(model, torch.randn(1, 16, 6, H, W), torch.full((1,), 500.0), text, start_frame=2)
    assert_same_snapshot(before, cache_snapshot(model))
    # A first forward is refused just the same, before anything is allocated.
    fresh = tiny_wan()
    _install(fresh, RollingKVCacheEngine(3))
    with pytest.raises(ValueError, match="chunk of 4 latent frames"):
        forward(fresh, torch.randn(1, 16, 4, H, W), torch.zeros(1), text, store_kv=True)
    assert fresh.kv_cache_engines["main"].memory_bytes() == 0 and engine.num_frames("pos") == 2


def test_relative_window_longer_than_the_rope_table():
    model = tiny_wan(rope_max_seq_len=4)
    engine = _install(model, RollingKVCacheEngine(6, positions="relative"))
    text, _ = conditioning(model, batch=1)
    with pytest.raises(ValueError, match=r"numbers the window's frames 0..5.*use window_frames <= 4"):
        forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, store_kv=True)
    assert engine.memory_bytes() == 0 and engine.num_frames("pos") == 0


def test_crop_and_skip_to():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(4, sink_frames=1))  # holds the sink and 2 recent frames
    text, _ = conditioning(model, batch=1)
    for start in range(6):
        forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=start, store_kv=True)
    assert engine.held_frames("pos") == [range(0, 1), range(4, 6)]
    with pytest.raises(ValueError, match="frames 1..3 were evicted"):
        engine.crop(3)
    # A chunk regenerated at frame 5 would attend to frames 3 and 4 (window 4, sink 1), but 3 was evicted: the crop
    # itself is refused, before it drops anything.
    with pytest.raises(ValueError, match="could not see its whole window"):
        engine.crop(5)
    assert engine.held_frames("pos") == [range(0, 1), range(4, 6)] and engine.next_frame("pos") == 6
    with pytest.raises(ValueError, match=r"skip_to\(2\).*>= 6"):
        engine.skip_to(2, "pos")
    engine.skip_to(9, "pos")
    assert engine.held_frames("pos") == [range(0, 1)] and engine.next_frame("pos") == 9
    forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=9, store_kv=True)
    assert engine.held_frames("pos") == [range(0, 1), range(9, 10)]
    engine.crop(1)
    assert engine.held_frames("pos") == [range(0, 1)]
    with pytest.raises(ValueError, match="holds 1 frames but start_frame=9"):
        forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=9)


def test_skip_to_needs_the_whole_sink_and_an_empty_window_reads_none():
    """A tag cropped into its sink cannot skip ahead (its sink slots would be read as committed frames), and a
    window holding none of the committed frames has no prefix."""
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(3, sink_frames=2))
    text, _ = conditioning(model, batch=1)
    forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, store_kv=True)
    with pytest.raises(ValueError, match="holds 1 of its 2 sink frames"):
        engine.skip_to(4, "pos")
    engine.crop(0)
    with pytest.raises(ValueError, match="holds 0 of its 2 sink frames"):
        engine.skip_to(4, "pos")
    assert engine.next_frame("pos") == 0
    engine = RollingKVCacheEngine(1)  # a chunk sees only itself: no committed frame is held
    forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, store_kv=True, cache_engines={"main": engine})
    assert engine.num_frames("pos") == 1 and engine.get_self_prefix(0, "pos") is None


def test_clear_one_tag():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(4))
    text, _ = conditioning(model, batch=1)
    for tag in ("pos", "neg"):
        forward(model, torch.randn(1, 16, 2, H, W), torch.zeros(1), text, cache_tag=tag, store_kv=True)
    engine.clear("neg")
    assert engine.num_frames("neg") == 0 and not engine.is_cross_init("neg")
    assert engine.num_frames("pos") == 2 and engine.is_cross_init("pos")
    other, _ = conditioning(model, batch=1, seed=8)  # the cleared tag takes new conditioning
    forward(model, torch.randn(1, 16, 2, H, W), torch.zeros(1), other, cache_tag="neg", store_kv=True)


@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_self_forcing_step_with_eviction_before_backward(positions):
    """Gradients of a grad-enabled chunk are the same with and without checkpointing, and the same whether the
    rollout evicts the frames the chunk attended to before ``backward()`` or not."""

    def run(checkpointing, evict):
        model = tiny_wan(layers=3)
        engine = _install(model, RollingKVCacheEngine(4, sink_frames=1, positions=positions))
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        text, _ = conditioning(model)
        g = torch.Generator().manual_seed(3)
        for start in range(4):  # prefill: the window is full
            forward(model, torch.randn(2, 16, 1, H, W, generator=g), torch.zeros(2), text, start_frame=start,
                    store_kv=True)
        x = torch.randn(2, 16, 2, H, W, generator=g)
        with CausalContext(model, start_frame=4, store_kv=True):
            out = model(hidden_states=x, timestep=torch.full((2,), 600.0), encoder_hidden_states=text,
                        return_dict=False)[0]
        if evict:  # the rollout moves on: every frame the chunk attended to (but the sink) is overwritten
            for start in range(6, 9):
                forward(model, torch.randn(2, 16, 1, H, W, generator=g), torch.zeros(2), text, start_frame=start,
                        store_kv=True)
            assert engine.held_frames("pos") == [range(0, 1), range(7, 9)]
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out_ref, grads_ref = run(checkpointing=False, evict=False)
    assert all(g.abs().sum() > 0 for g in grads_ref[:3])
    for checkpointing, evict in ((False, True), (True, False), (True, True)):
        out, grads = run(checkpointing, evict)
        assert torch.equal(out, out_ref)
        for a, b in zip(grads_ref, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_self_forcing_rollout_through_the_window_with_and_without_checkpointing(positions):
    """Every chunk keeps gradients and the window evicts while the rollout goes on, the first chunks (which attend
    to nothing cached) included; the checkpointing recomputation must see what each forward saw."""

    def grads(checkpointing):
        model = tiny_wan(layers=2)
        _install(model, RollingKVCacheEngine(3, sink_frames=1, positions=positions))
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        text, _ = conditioning(model)
        noise = torch.randn(2, 16, 6, H, W, generator=torch.Generator().manual_seed(4))
        result = self_forcing_rollout(model, noise, text, exit_step=1, chunk_frames=1, timesteps=[1000, 500],
                                      generator=torch.Generator().manual_seed(5))
        result.latents.square().mean().backward()
        return result.latents.detach(), [p.grad.clone() for p in model.parameters()]

    (out_plain, plain), (out_ckpt, ckpt) = grads(False), grads(True)
    torch.testing.assert_close(out_plain, out_ckpt, rtol=0, atol=1e-6)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("positions, sink", [("absolute", 1), ("relative", 0)])
def test_vace_gets_a_rolling_engine_per_branch(positions, sink):
    """Both VACE branches roll their own window; the output matches the window-masked full forward of both streams
    (the stock VACE forward takes one timestep per sample, so the commits run at the chunk's timestep). Relative
    positions match the absolute reference without a sink (with one, the gap after the sink is closed)."""
    from helpers import VACE_CHANNELS, tiny_vace

    model = tiny_vace()
    engines = {"main": RollingKVCacheEngine(3, sink, positions=positions),
               "vace": RollingKVCacheEngine(3, sink, positions=positions)}
    _install(model, engines["main"])
    model.kv_cache_engines["vace"] = engines["vace"]
    text, _ = conditioning(model, batch=1)
    g = torch.Generator().manual_seed(2)
    chunks, t = [1] * 5, torch.full((1,), 500.0)
    control = torch.randn(1, VACE_CHANNELS, 5, H, W, generator=g)
    committed = []
    for k in range(5):
        x = torch.randn(1, 16, 1, H, W, generator=g)
        extra = {"control_hidden_states": control[:, :, k:k + 1]}
        out = forward(model, x, t, text, extra=extra, start_frame=k)
        mask = window_mask(chunks[:k + 1], FRAME_TOKENS, 3, sink)
        with torch.no_grad():
            ref = masked_full_forward(model, torch.cat(committed + [x], dim=2), t, text, None, mask,
                                      control_hidden_states=control[:, :, :k + 1])[:, :, k:]
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5, msg=f"chunk {k}")
        forward(model, x, t, text, extra=extra, start_frame=k, store_kv=True)
        committed.append(x)
    held = [range(0, 1), range(4, 5)] if sink else [range(3, 5)]
    assert all(e.held_frames("pos") == held for e in engines.values())


def test_branches_must_agree_on_positions():
    from helpers import VACE_CHANNELS, tiny_vace

    model = tiny_vace()
    _install(model, RollingKVCacheEngine(3, positions="relative"))
    model.kv_cache_engines["vace"] = RollingKVCacheEngine(3)
    text, _ = conditioning(model, batch=1)
    extra = {"control_hidden_states": torch.zeros(1, VACE_CHANNELS, 1, H, W)}
    for start in range(3):  # the windows agree while they fill
        forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, extra=extra, start_frame=start,
                store_kv=True)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=r"different RoPE positions \[2, 3\].*same kind of engine and positions"):
        forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, extra=extra, start_frame=3)
    assert_same_snapshot(before, cache_snapshot(model))


def test_failed_first_commit_allocates_nothing_and_keeps_a_skip(monkeypatch):
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(4))
    text, _ = conditioning(model, batch=1)
    engine.skip_to(5, "pos")

    def out_of_memory(*args):
        raise MemoryError("simulated out of memory while allocating the ring buffers")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "_allocate", out_of_memory)
        with pytest.raises(MemoryError, match="simulated"):
            forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=5, store_kv=True)
    assert engine.tags() == [] and engine.memory_bytes() == 0 and engine.next_frame("pos") == 5
    forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=5, store_kv=True)
    assert engine.held_frames("pos") == [range(5, 6)] and engine.next_frame("pos") == 6


def test_inference_mode_rollout_continues_outside_it():
    model = tiny_wan()
    engine = _install(model, RollingKVCacheEngine(3, sink_frames=1))
    text, _ = conditioning(model, batch=1)
    with torch.inference_mode():
        for start in range(3):
            forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=start, store_kv=True)
    for start in range(3, 5):  # outside inference mode: evicts (writes into) inference-mode storage
        forward(model, torch.randn(1, 16, 1, H, W), torch.zeros(1), text, start_frame=start, store_kv=True)
    engine.clear("pos")
    assert engine.num_frames("pos") == 0
