"""fp8 KV cache (``kv_dtype=torch.float8_e4m3fn``) on every engine.

Tolerance, derived from the format. e4m3 keeps 3 mantissa bits: neighbouring codes are at most 2^-3 apart relative
to the smaller one, so rounding to the nearest moves an element by at most ``eps / 2 = 2^-4`` of its value (``eps``:
``torch.finfo(dtype).eps``), plus, for codes below e4m3's smallest normal number ``2^-6``, half a subnormal step,
``2^-10`` code units, i.e. ``2^-10 x scale`` (``scale = group amax / 448``). So every cached element ``x`` comes back
as ``x + d`` with ``|d| <= 2^-4 |x| + 2^-10 scale`` (:func:`_element_bound`).

Attention over the dequantized prefix, ``o = softmax(q K^T / sqrt(d)) V``: an error ``dV`` enters ``o`` through a
convex combination, so by at most ``max |dV|``; an error ``dk_j`` shifts score ``j`` by at most
``e = max_j |q . dk_j| / sqrt(d)``, which scales every softmax weight by a factor in ``[e^-2e, e^2e]``, so the weights
move by at most ``e^2e - 1`` in total and ``o`` by at most ``(e^2e - 1) max |V|`` more
(:func:`test_attention_error_within_the_fp8_bound`).

Above the attention the error passes through the network (norms, FFN, residuals), where no bound follows from the
format. The model-level tests therefore compare with a reference that isolates the quantization: the same engine
storing K/V as computed but rounded on commit by :func:`_fake_quant` (written out per frame and group, independently of
the package's packing), which the existing equivalence tests already tie to a full-sequence stock forward. The fp8
engine must match it to fp32 round-off (``ATOL``): it adds no error beyond the rounding of what it stores, whatever
the engine does with the frames (rings, crops, evictions, static buffers, relative positions, gradient passes). The
error against the unquantized cache over a rollout is measured by ``benchmarks/kv_quantization.py``.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_snapshot, cache_snapshot, conditioning, forward, same_tensor, tiny_wan

from diffusers_causal_kv import (
    CausalWanAttnProcessor,
    KVCacheEngine,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
    self_forcing_rollout,
)
from diffusers_causal_kv.kv_cache import CrossEntry, PassInfo, StagedChunk
from diffusers_causal_kv.kv_cache.quantized import GROUP_TOKENS, Float8Storage

FP8 = torch.float8_e4m3fn
FRAME_TOKENS = 4  # 4x4 latents, patch (1, 2, 2)
BATCH, HEADS, HEAD_DIM, TEXT_LEN = 2, 2, 12, 12
ATOL = 1e-6  # fp32 round-off: the fp8 engine against the fake-quantized reference
STATIC_MAX_FRAMES = 12

# name -> (engine class, constructor arguments); the rolling window (4 frames, 1 sink) evicts in every rollout here.
ENGINES = {
    "vanilla": (VanillaKVCacheEngine, {}),
    "static": (StaticKVCacheEngine, {"max_frames": STATIC_MAX_FRAMES}),
    "rolling": (RollingKVCacheEngine, {"window_frames": 4, "sink_frames": 1}),
    "rolling-relative": (RollingKVCacheEngine, {"window_frames": 4, "sink_frames": 1, "positions": "relative"}),
}


# ---------------------------------------------------------------------------------------------- references
def _fake_quant(x: torch.Tensor, frame_tokens: int, dtype: torch.dtype = FP8) -> torch.Tensor:
    """``x`` (``[batch, tokens, heads, head_dim]``) rounded as fp8 storage rounds it, written out per frame and group:
    per batch row and head, a group of ``GROUP_TOKENS`` tokens of a frame is scaled by ``amax / code_max`` (1 for an
    all-zero group), rounded to ``dtype`` and scaled back."""
    code_max = torch.finfo(dtype).max
    out = torch.empty_like(x)
    for frame in range(0, x.shape[1], frame_tokens):
        for start in range(frame, frame + frame_tokens, GROUP_TOKENS):
            group = x[:, start:min(start + GROUP_TOKENS, frame + frame_tokens)].float()
            scale = group.abs().amax(dim=(1, 3), keepdim=True) / code_max
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = (group / scale).clamp(-code_max, code_max).to(dtype)
            out[:, start:start + group.shape[1]] = (codes.float() * scale).to(x.dtype)
    return out


def _element_bound(x: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """Largest rounding error of each element of ``x`` (one frame): half a mantissa step of the value plus half a
    subnormal step of the scale (module docstring), the scale taken from the frame's amax (at least its groups')."""
    info = torch.finfo(dtype)
    scale = x.abs().amax(dim=(1, 3), keepdim=True) / info.max
    return info.eps / 2 * x.abs() + info.smallest_normal * info.eps / 2 * scale


def _fake_quantized(cls, dtype=FP8):
    """``cls`` storing K/V as computed, but rounded on commit as the fp8 format rounds them (the reference)."""

    class FakeQuantized(cls):
        def _write(self, entry, key, value):
            super()._write(entry, _fake_quant(key, FRAME_TOKENS, dtype), _fake_quant(value, FRAME_TOKENS, dtype))

        def read_cross(self, block_idx, cache_tag):
            entry = super().read_cross(block_idx, cache_tag)
            if entry is None:
                return None
            return CrossEntry(*(None if t is None else _fake_quant(t, t.shape[1], dtype)
                                          for t in (entry.key, entry.value, entry.key_img, entry.value_img)))

    return FakeQuantized


def _engines(name, dtype=FP8):
    """(fp8 engine, fake-quantized reference engine) of one kind."""
    cls, kwargs = ENGINES[name]
    return cls(**kwargs, kv_dtype=dtype), _fake_quantized(cls, dtype)(**kwargs)


def _installed(engine, **config):
    model = tiny_wan(**config)
    model.kv_cache_engines = {"main": engine}
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _rollout(model, chunks, tags=("pos", "neg"), steps=(600.0,), seed=3):
    """Denoising passes then a commit per chunk and tag; returns every output."""
    g = torch.Generator().manual_seed(seed)
    channels = model.config.in_channels
    cond = {tag: conditioning(model, batch=BATCH, seed=11 + i) for i, tag in enumerate(tags)}
    outputs, start = [], 0
    for size in chunks:
        for step in steps + (0.0,):
            for tag in tags:
                x = torch.randn(BATCH, channels, size, 4, 4, generator=g)
                outputs.append(forward(model, x, torch.full((BATCH,), step), *cond[tag], start_frame=start,
                                       cache_tag=tag, store_kv=step == 0.0))
        start += size
    return outputs


def _entry_bytes(tokens: int, frame_tokens: int, batch=BATCH, heads=HEADS, head_dim=HEAD_DIM) -> int:
    """Analytic bytes of K and V of ``tokens`` tokens in fp8: one code byte per element, plus per token and head the
    bytes that hold the frame's float32 scales (one per group of ``GROUP_TOKENS`` tokens) spread over its tokens."""
    scale_bytes_per_token = math.ceil(4 * math.ceil(frame_tokens / GROUP_TOKENS) / frame_tokens)
    return 2 * batch * tokens * heads * (head_dim + scale_bytes_per_token)


# ---------------------------------------------------------------------------------------------- the format
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("frame_tokens", [1, 2, 3, 4, 64, 70, 130])
def test_storage_rounds_each_group_as_the_reference(frame_tokens, dtype):
    storage = Float8Storage(dtype)
    g = torch.Generator().manual_seed(frame_tokens)
    x = torch.randn(2, 3 * frame_tokens, 3, 8, generator=g)
    x[:, :frame_tokens] *= 1e3  # frames of very different ranges get their own scales
    x[1, frame_tokens:2 * frame_tokens, 1] = 0  # an all-zero group
    stored = storage.encode(x, frame_tokens)
    extra = math.ceil(4 * math.ceil(frame_tokens / GROUP_TOKENS) / frame_tokens)
    assert stored.dtype == torch.uint8 and stored.shape == (2, 3 * frame_tokens, 3, 8 + extra)
    decoded = storage.decode(stored, frame_tokens, torch.float32)
    assert torch.equal(decoded, _fake_quant(x, frame_tokens, dtype))
    assert not decoded[1, frame_tokens:2 * frame_tokens, 1].any()
    for frame in range(3):  # the bound from the frame's amax holds for each of its groups (whose amax is smaller)
        part = slice(frame * frame_tokens, (frame + 1) * frame_tokens)
        assert ((decoded[:, part] - x[:, part]).abs() <= _element_bound(x[:, part], dtype)).all()
    # A slice of whole frames decodes on its own (what the engines hand back), in the dtype asked for.
    middle = storage.decode(stored[:, frame_tokens:2 * frame_tokens], frame_tokens, torch.bfloat16)
    assert middle.dtype == torch.bfloat16
    assert torch.equal(middle, decoded[:, frame_tokens:2 * frame_tokens].to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------- attention
def _pass(start, frames, grad=False, store=False):
    return PassInfo("pos", start, frames, FRAME_TOKENS, 1, torch.float32, torch.device("cpu"), grad, store)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_attention_error_within_the_fp8_bound(name):
    """What ``update`` hands the attention: the prefix within the per-element bound of the unquantized engine's, the
    chunk exact, and the attention output within ``(e^2e - 1) max |V| + max |dV|`` (module docstring)."""
    heads, head_dim = 4, 64
    cls, kwargs = ENGINES[name]
    fp8, exact = cls(**kwargs, kv_dtype=FP8), cls(**kwargs)
    g = torch.Generator().manual_seed(0)
    for engine in (fp8, exact):
        engine.register_module(torch.nn.Identity(), 0)
    channel_gain = torch.ones(head_dim)
    channel_gain[:4] = 8.0  # outlier channels, as real keys have

    def chunk(frames):
        shape = (1, frames * FRAME_TOKENS, heads, head_dim)
        return torch.randn(shape, generator=g) * channel_gain, torch.randn(shape, generator=g)

    start = 0
    for frames in (2, 1, 2):  # the rolling engines evict frames 1 and 2
        key, value = chunk(frames)
        for engine in (fp8, exact):
            info = _pass(start, frames, store=True)
            staged = StagedChunk(self_kv={0: (key, value)})
            engine.prepare_commit(info, staged)
            engine.commit(info, staged)
        start += frames

    key, value = chunk(1)
    query = torch.randn(1, FRAME_TOKENS, heads, head_dim, generator=g)
    for grad in (False, True):
        ours, theirs = (e.update(0, _pass(start, 1, grad=grad), key, value, None) for e in (fp8, exact))
        assert torch.equal(ours.key[:, -FRAME_TOKENS:], key) and torch.equal(ours.value[:, -FRAME_TOKENS:], value)
        assert ours.key.shape == theirs.key.shape
        for got, want in ((ours.key, theirs.key), (ours.value, theirs.value)):
            for f in range(want.shape[1] // FRAME_TOKENS):
                frame = slice(f * FRAME_TOKENS, (f + 1) * FRAME_TOKENS)
                assert ((got[:, frame] - want[:, frame]).abs() <= _element_bound(want[:, frame])).all()
        out_ours, out_theirs = (F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, kv.key, kv.value)))
                                for kv in (ours, theirs))
        score_shift = (torch.einsum("bqhd,bkhd->bhqk", query, ours.key - theirs.key).abs().amax()
                       / math.sqrt(head_dim))
        bound = (math.exp(2 * score_shift) - 1) * theirs.value.abs().max() + (ours.value - theirs.value).abs().max()
        error = (out_ours - out_theirs).abs().max()
        assert 0 < error <= bound, (error, bound)


# ---------------------------------------------------------------------------------------------- model level
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_rollout_equals_the_fake_quantized_reference(name):
    """Two tags, uneven chunks, denoising passes and commits (the rolling windows evict): every output equals the
    reference's, and the quantization is not vacuous (the unquantized cache gives other outputs)."""
    fp8, reference = _engines(name)
    chunks = [2, 1, 3, 1]
    ours = _rollout(_installed(fp8), chunks)
    theirs = _rollout(_installed(reference), chunks)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"output {k}")
    cls, kwargs = ENGINES[name]
    plain = _rollout(_installed(cls(**kwargs)), chunks)
    assert max((a - b).abs().max().item() for a, b in zip(ours, plain)) > 1e-4
    assert fp8.num_frames("pos") == fp8.num_frames("neg") == sum(chunks)
    if isinstance(fp8, RollingKVCacheEngine):
        assert fp8.held_frames("pos") == reference.held_frames("pos") == [range(0, 1), range(5, 7)]


def test_i2v_cross_entries_with_image_tokens():
    fp8, reference = _engines("vanilla")
    ours, theirs = (_rollout(_installed(e, i2v=True), [1, 2], tags=("pos",), steps=(500.0,))
                    for e in (fp8, reference))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    entry = fp8.read_cross(0, "pos")
    assert entry.key_img is not None and entry.key_img.dtype == torch.float32


def test_rolling_eviction_keeps_the_rounded_frames():
    """Frames written over the oldest ones in place: the window holds exactly the reference's rounded frames, at a
    constant memory."""
    fp8, reference = _engines("rolling")
    memory = []
    for engine in (fp8, reference):
        model = _installed(engine)
        text, _ = conditioning(model, batch=BATCH)
        g = torch.Generator().manual_seed(4)
        for start in range(7):
            forward(model, torch.randn(BATCH, 16, 1, 4, 4, generator=g), torch.zeros(BATCH), text,
                    start_frame=start, store_kv=True)
            if engine is fp8:
                memory.append(fp8.memory_bytes())
    assert fp8.held_frames("pos") == [range(0, 1), range(5, 7)]
    assert len(set(memory)) == 1
    for block in range(2):
        for a, b in zip(fp8.get_self_prefix(block, "pos"), reference.get_self_prefix(block, "pos")):
            assert a.shape == (BATCH, 3 * FRAME_TOKENS, HEADS, HEAD_DIM) and torch.equal(a, b)


@pytest.mark.parametrize("name", ["vanilla", "static"])
def test_crop_with_fp8(name):
    """Crops drop whole frames, mid-chunk too; re-committing the dropped frames gives the uncropped cache."""
    cls, kwargs = ENGINES[name]
    engine = cls(**kwargs, kv_dtype=FP8)
    model = _installed(engine)
    text, _ = conditioning(model, batch=BATCH)
    chunks = [torch.randn(BATCH, 16, size, 4, 4, generator=torch.Generator().manual_seed(size)) for size in (2, 3)]
    forward(model, chunks[0], torch.zeros(BATCH), text, start_frame=0, store_kv=True)
    two = [t.clone() for t in engine.get_self_prefix(1, "pos")]
    forward(model, chunks[1], torch.zeros(BATCH), text, start_frame=2, store_kv=True)
    five = [t.clone() for t in engine.get_self_prefix(1, "pos")]
    full_bytes = engine.memory_bytes()

    engine.crop(3)  # into the second chunk
    assert engine.num_frames("pos") == engine.next_frame("pos") == 3
    assert all(torch.equal(a, b[:, :3 * FRAME_TOKENS]) for a, b in zip(engine.get_self_prefix(1, "pos"), five))
    dropped = 0 if name == "static" else 2 * _entry_bytes(2 * FRAME_TOKENS, FRAME_TOKENS)  # 2 blocks, 2 frames
    assert engine.memory_bytes() == full_bytes - dropped
    engine.crop(-1)
    assert all(torch.equal(a, b) for a, b in zip(engine.get_self_prefix(1, "pos"), two))
    forward(model, chunks[1], torch.zeros(BATCH), text, start_frame=2, store_kv=True)
    assert all(torch.equal(a, b) for a, b in zip(engine.get_self_prefix(1, "pos"), five))
    assert engine.memory_bytes() == full_bytes


# ---------------------------------------------------------------------------------------------- memory
def test_memory_bytes_is_the_analytic_size():
    blocks = 2
    cross = blocks * _entry_bytes(TEXT_LEN, TEXT_LEN)  # per tag: the whole text is one group
    for name, held in (("vanilla", lambda frames: frames), ("static", lambda frames: STATIC_MAX_FRAMES),
                       ("rolling", lambda frames: 3)):  # the ring: W - 1 frames
        cls, kwargs = ENGINES[name]
        engine = cls(**kwargs, kv_dtype=FP8)
        model = _installed(engine)
        assert engine.memory_bytes() == 0
        for tag, frames in (("pos", 3), ("neg", 2)):
            text, _ = conditioning(model, batch=BATCH, seed=len(tag))
            forward(model, torch.randn(BATCH, 16, frames, 4, 4), torch.zeros(BATCH), text, start_frame=0,
                    store_kv=True, cache_tag=tag)
        self_bytes = blocks * sum(_entry_bytes(held(f) * FRAME_TOKENS, FRAME_TOKENS) for f in (3, 2))
        assert engine.memory_bytes() == self_bytes + 2 * cross, name
        engine.clear()
        assert engine.memory_bytes() == 0


def test_fp8_holds_at_most_055_of_bf16_at_the_small_preset_frame():
    """benchmarks/rollout.py's ``small`` preset: 4 heads of 64, 16x16 latents (64 tokens per frame), in bf16."""
    memory = {}
    for kv_dtype in (None, FP8):
        model = tiny_wan(heads=4, head_dim=64, layers=1, dtype=torch.bfloat16)
        model.kv_cache_engines = {"main": KVCacheEngine(kv_dtype=kv_dtype)}
        model.set_attn_processor(CausalWanAttnProcessor())
        text, _ = conditioning(model, batch=1, text_len=64)
        x = torch.randn(1, 16, 2, 16, 16)
        forward(model, x.bfloat16(), torch.zeros(1), text.bfloat16(), start_frame=0, store_kv=True)
        memory[kv_dtype] = model.kv_cache_engines["main"].memory_bytes()
    assert memory[None] == 2 * (2 * 64 + 64) * 4 * 64 * 2
    assert memory[FP8] == _entry_bytes(2 * 64 + 64, 64, batch=1, heads=4, head_dim=64)
    assert memory[FP8] / memory[None] == (64 + 1) / (2 * 64) <= 0.55


# ---------------------------------------------------------------------------------------------- gradients
def test_self_forcing_reads_dequantized_copies():
    """Gradient passes attend over dequantized copies (gradients equal the reference's) and later commits, which
    quantize into storage, leave the graph alone."""
    results = []
    for engine in _engines("static"):
        model = _installed(engine, layers=2).train()
        text, _ = conditioning(model)
        noise = torch.randn(BATCH, 16, 5, 4, 4, generator=torch.Generator().manual_seed(5))
        result = self_forcing_rollout(model, noise, text, exit_step=[1, 0, 1], chunk_frames=[1, 2, 2],
                                      timesteps=[1000, 500], generator=torch.Generator().manual_seed(9))
        model.zero_grad()
        result.latents.square().mean().backward()
        held = [t for block in range(2) for t in engine.get_self_prefix(block, "pos")]
        assert not any(t.requires_grad for t in held)
        results.append((result.latents.detach(), [p.grad.clone() for p in model.parameters()]))
    (latents, grads), (ref_latents, ref_grads) = results
    torch.testing.assert_close(latents, ref_latents, rtol=0, atol=ATOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- bookkeeping
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_empty_like_and_repr_carry_kv_dtype(name):
    cls, kwargs = ENGINES[name]
    engine = cls(**kwargs, kv_dtype=FP8)
    twin = engine.empty_like()
    assert type(twin) is cls and twin.kv_dtype is FP8 and twin.tags() == []
    assert repr(engine).endswith("kv_dtype=torch.float8_e4m3fn)")
    assert "kv_dtype" not in repr(cls(**kwargs)) and cls(**kwargs).empty_like().kv_dtype is None


def test_adopt_tag_refuses_another_kv_dtype():
    engine = RollingKVCacheEngine(3, kv_dtype=FP8)
    with pytest.raises(ValueError, match=r"adopt_tag\(\) takes the tag of an engine .* and kv_dtype "
                                         r"torch.float8_e4m3fn"):
        engine.adopt_tag(RollingKVCacheEngine(3), "pos")
    engine.adopt_tag(engine.empty_like(), "pos")


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_a_refused_forward_leaves_the_fp8_cache_unchanged(name):
    engine, _ = _engines(name)
    model = _installed(engine)
    text, _ = conditioning(model, batch=BATCH)
    forward(model, torch.randn(BATCH, 16, 2, 4, 4), torch.zeros(BATCH), text, start_frame=0, store_kv=True)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match="call clear_caches"):
        forward(model, torch.randn(BATCH, 16, 1, 4, 4), torch.zeros(BATCH), text, start_frame=3, store_kv=True)
    with pytest.raises(ValueError, match="was built with"):
        forward(model, torch.randn(1, 16, 1, 4, 4), torch.zeros(1), text[:1], start_frame=2, store_kv=True)
    assert_same_snapshot(before, cache_snapshot(model))


@pytest.mark.parametrize("name", ["static", "rolling"])
def test_buffers_allocated_under_inference_mode_take_later_commits(name):
    engine, _ = _engines(name)
    model = _installed(engine)
    text, _ = conditioning(model, batch=BATCH)
    with torch.inference_mode():
        forward(model, torch.randn(BATCH, 16, 1, 4, 4), torch.zeros(BATCH), text, start_frame=0, store_kv=True)
    for start in (1, 2):
        forward(model, torch.randn(BATCH, 16, 1, 4, 4), torch.zeros(BATCH), text, start_frame=start, store_kv=True)
    assert engine.num_frames("pos") == 3


@pytest.mark.parametrize("bad", [torch.bfloat16, torch.int8, torch.float8_e4m3fnuz, "fp8"])
def test_other_kv_dtypes_are_refused(bad):
    for build in (lambda: KVCacheEngine(kv_dtype=bad), lambda: StaticKVCacheEngine(4, kv_dtype=bad),
                  lambda: RollingKVCacheEngine(4, kv_dtype=bad)):
        with pytest.raises(ValueError, match=r"kv_dtype must be None .* torch.float8_e4m3fn, torch.float8_e5m2 .*"
                                             "got " + repr(bad)):
            build()


def test_e5m2_rollout_equals_its_reference():
    fp8, reference = _engines("vanilla", torch.float8_e5m2)
    for a, b in zip(_rollout(_installed(fp8), [1, 2], tags=("pos",)), _rollout(_installed(reference), [1, 2],
                                                                                tags=("pos",))):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_benchmark_reports_memory_and_errors(capsys):
    """benchmarks/kv_quantization.py at --size tiny: every field, memory equal to the analytic size (no timings)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_quantization.py"
    spec = importlib.util.spec_from_file_location("kv_quantization_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    benchmark.main(["--size", "tiny"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert "fp8 / bf16 memory" in out and report["memory_bytes_match"]
    assert report["memory_bytes"] == report["memory_bytes_analytic"]
    assert report["fp8_vs_bf16_memory_ratio"] <= report["target_memory_ratio"] == 0.55
    assert set(report["errors"]) == {label for label, _, _ in benchmark.COMPARISONS}
    for error in report["errors"].values():
        for part in ("flow", "final_latents"):
            assert 0 < error[part]["mean_abs"] <= error[part]["max_abs"] < error[part]["reference_mean_abs"]


def test_snapshot_comparison_takes_float8_tensors():
    """tests/helpers.py compares snapshots bytewise where torch.equal refuses float8 on CPU."""
    codes = torch.randn(2, 3).to(FP8)
    before = {"main": ({}, 0, [codes])}
    assert_same_snapshot(before, {"main": ({}, 0, [codes.clone()])})
    changed = codes.clone()
    changed.view(torch.uint8)[0, 0] += 1
    for other in (changed, codes.to(torch.float8_e5m2), codes.float()):
        assert not same_tensor(codes, other)
