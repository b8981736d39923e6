"""Property-based tests (hypothesis) of the engines, against a plain-Python model of the cache.

The model (:class:`CacheModel`) knows only the documented rules: which frames a tag holds after commits, crops,
clears and skips, which frames a chunk attends to (every earlier frame, or the rolling engine's window rule: the
sink plus the recent frames the window promises, whatever the engine happens to hold), which forwards and crops
must fail and with which error, and how many bytes each engine holds. Every frame ever committed is kept in a
history with the latent, timestep, RoPE position, LoRA scale and dtype it was computed with and the set of frames
it attended to, so whatever the engine holds can be recomputed from scratch: one stock full-sequence forward over
the frames a chunk depends on, with a frame-level attention mask built from those sets and RoPE tables gathered at
the frames' positions. The engine must agree on its outputs and on the K/V it holds (to 1e-5 in fp32; bfloat16
passes against the fp32 reference to :data:`BF16_ATOL`); a forward or crop that must fail raises and leaves the
engine exactly as before.

The test model carries a PEFT LoRA adapter on every attention projection, so a forward's ``attention_kwargs=
{"scale": s}`` changes the K/V a tag caches: a tag filled at one scale must refuse passes at another (its K/V are
stale there) and give the reference's results at its own.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from helpers import assert_same_snapshot, block_causal_mask, cache_snapshot, masked_full_forward, tiny_wan, window_mask
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from peft import LoraConfig

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
    clear_caches,
)

ROPE_LEN = 16  # a short RoPE table, so sequences run into its end
STATIC_FRAMES = 10
BLOCKS, HEADS, HEAD_DIM, TEXT_LEN = 2, 2, 12, 6
FRAME_TOKENS = 4  # 4x4 latents, patch 2x2
TAGS = ("pos", "neg")
CHURN_TAGS = tuple(f"req{i}" for i in range(8))  # many short-lived tags, as a server with one tag per request
ALL_TAGS = TAGS + CHURN_TAGS
SCALES = (1.0, 0.5)  # LoRA scales a forward passes as attention_kwargs={"scale": s}
# bfloat16 passes run under CPU autocast (the projections, and so the cached K/V, take bfloat16) on the same model:
# one engine serves one transformer, so a bf16 copy of the model could not share the engine with fp32 tags.
BF16 = torch.bfloat16
# Outputs and K/V of bf16 passes against the fp32 reference: bf16 keeps 8 mantissa bits (a relative error of 2**-9
# per rounding); outputs here reach |x| ~ 5 after two blocks over cached bf16 K/V, and the errors seen stay below
# 0.03 (0.021 past the relative part). Another LoRA scale or one frame attended more or less moves some output by
# more than this (test_the_reference_sees_the_lora_scale_and_the_bf16_tolerance_sees_a_missing_frame).
BF16_ATOL, BF16_RTOL = 0.06, 0.02
# fp8 storage (kv_dtype=torch.float8_e4m3fn). e4m3 keeps 3 mantissa bits, so rounding to the nearest code moves an
# element by at most eps / 2 = 2**-4 of its value, plus half a subnormal step of its group's scale (2**-10 x amax / 448,
# below 1e-5 for the K/V here): the K/V an engine holds match the reference's to rtol 2**-4 on top of the pass's own
# tolerance (and, from the second block on, plus what the earlier blocks' attention over rounded K/V passed on, bounded
# as the outputs are). Outputs: a relative error r in the cached keys shifts a score by at most r |q . k| / sqrt(d),
# which scales softmax weights by up to e**(2 r |s|) and so moves the attention output by a fraction of max |V|; through
# two blocks (norms, FFN, residuals) no bound follows from the format, so the output tolerance is the key/value rounding
# scaled by FP8_OUTPUT_GAIN: the largest output error beyond the pass's own tolerance, in units of 2**-4, seen over
# these operations (0.74, 250 examples per fp8 engine, outputs |x| ~ 1-5), with a margin of 2.7x. A missing frame still
# moves outputs by more (test_the_reference_sees_the_lora_scale_and_the_bf16_tolerance_sees_a_missing_frame).
FP8 = torch.float8_e4m3fn
FP8_RELATIVE = torch.finfo(FP8).eps / 2
FP8_OUTPUT_GAIN = 2.0
PROPERTY_SETTINGS = settings(max_examples=140, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Under bf16 autocast, RMSNorm warns that its fp32 weight meets bf16 input (it then runs unfused); expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")

MODEL = tiny_wan(layers=BLOCKS, heads=HEADS, head_dim=HEAD_DIM, rope_max_seq_len=ROPE_LEN)
with torch.random.fork_rng():  # reproducible adapter weights, without touching the global RNG of other tests
    torch.manual_seed(1)  # init_lora_weights=False: random B too, so the adapter (and its scale) changes every output
    MODEL.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False), adapter_name="p")
MODEL.set_attn_processor(CausalWanAttnProcessor())
FAULT = {"armed": False}


def _fault_hook(module, args):
    if FAULT["armed"]:
        raise RuntimeError("injected fault in block 1")


MODEL.blocks[1].ffn.register_forward_pre_hook(_fault_hook)


def _text(seed: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, TEXT_LEN, 32, generator=torch.Generator().manual_seed(100 + seed))


def _latent(seed: int, batch: int, frames: int) -> torch.Tensor:
    return torch.randn(batch, 16, frames, 4, 4, generator=torch.Generator().manual_seed(seed))


def _tolerance(dtype, kv_dtype, part):
    """(rtol, atol) of an engine's ``part`` (``"kv"``: what it holds, ``"output"``) against the fp32 reference, for
    a pass in ``dtype`` on an engine storing ``kv_dtype``; ``None``: the pass's own."""
    if kv_dtype is None:
        return None
    rtol, atol = (BF16_RTOL, BF16_ATOL) if dtype == BF16 else (0, 1e-5)
    propagated = FP8_OUTPUT_GAIN * FP8_RELATIVE  # what attention over rounded K/V passes on (to later blocks too)
    if part == "kv":  # rounded on top of what the earlier blocks passed on
        return rtol * (1 + FP8_RELATIVE) + FP8_RELATIVE, (atol + propagated) * (1 + FP8_RELATIVE) + 1e-5
    return rtol, atol + propagated


def _assert_close(got, expected, dtype, msg, tolerance=None):
    """``got`` against the fp32 reference: fp32 round-off, or ``tolerance`` (``(rtol, atol)``) where the pass's
    dtype or the engine's fp8 storage rounds more."""
    if tolerance is None:
        tolerance = (BF16_RTOL, BF16_ATOL) if dtype == BF16 else (0, 1e-5)
    torch.testing.assert_close(got.float(), expected, rtol=tolerance[0], atol=tolerance[1], msg=msg)


# ---------------------------------------------------------------------------------------------- the reference
_SERIALS = itertools.count()


@dataclass(eq=False)
class Frame:
    """One latent frame as it was computed: its input, timestep, RoPE position, LoRA scale, dtype and the frames it
    attended to."""

    latent: torch.Tensor  # [batch, channels, 1, h, w]
    timestep: float
    position: int
    text: torch.Tensor
    scale: float = 1.0
    dtype: torch.dtype = torch.float32  # of the pass (the reference always runs in fp32)
    visible: list = field(default_factory=list)  # Frames, its own chunk included
    kv: list | None = None  # per block (key, value), as the reference computed them (see reference())
    serial: int = field(default_factory=lambda: next(_SERIALS))  # creation order: a frame sees earlier ones only


def _closure(frames: list[Frame]) -> list[Frame]:
    """``frames`` and every frame they depend on, in creation order."""
    seen, todo = {}, list(frames)
    while todo:
        f = todo.pop()
        if id(f) not in seen:
            seen[id(f)] = f
            todo += f.visible
    return sorted(seen.values(), key=lambda f: f.serial)


def _rotary_tables(positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock RoPE tables of a sequence whose frames sit at ``positions`` (taken from the table of all positions)."""
    cos, sin = MODEL.rope(torch.zeros(1, 16, ROPE_LEN, 4, 4))
    rows = torch.tensor([p * FRAME_TOKENS + i for p in positions for i in range(FRAME_TOKENS)])
    return cos[:, rows], sin[:, rows]


class ReferenceProcessor:
    """Stock attention with a fixed self-attention mask and RoPE tables; records each block's self K/V. The LoRA
    layers live in ``attn.to_q``/``to_k``/``to_v``/``to_out``, not in the processor, so they apply here as in the
    stock processor, at the scale the forward's ``attention_kwargs`` set on them."""

    def __init__(self, mask, rotary, records):
        self.stock, self.mask, self.rotary, self.records = WanAttnProcessor(), mask, rotary, records

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:
            return self.stock(attn, hidden_states, encoder_hidden_states, None, rotary_emb)
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        self.records.append((_rotate(key, *self.rotary), value))
        return self.stock(attn, hidden_states, None, self.mask, self.rotary)


def _rotate(x, cos, sin):
    """RoPE on interleaved pairs, written with complex numbers (the stock processor uses real arithmetic)."""
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    turn = torch.complex(cos[..., 0::2].double(), sin[..., 1::2].double())
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def reference(frames: list[Frame]):
    """Stock fp32 forward over ``frames`` and their dependencies, at their LoRA scale: (output of each of
    ``frames``, per-block self K/V of each of ``frames``), each frame's attention restricted to its ``visible``
    set. A frame's K/V depend on its dependencies only, so each of ``frames`` also keeps its own in ``kv``: the K/V
    an engine must hold for a set of committed frames are theirs, without another forward."""
    seq = _closure(frames)
    scales = {f.scale for f in seq}
    assert len(scales) == 1, "a tag's frames share one LoRA scale (the engine refuses another)"
    index = {id(f): i for i, f in enumerate(seq)}
    allowed = torch.tensor([[any(g is v for v in f.visible) for g in seq] for f in seq])
    mask = allowed.repeat_interleave(FRAME_TOKENS, 0).repeat_interleave(FRAME_TOKENS, 1)
    records = []
    processor = ReferenceProcessor(mask, _rotary_tables([f.position for f in seq]), records)
    timestep = torch.tensor([f.timestep for f in seq]).repeat_interleave(FRAME_TOKENS)
    batch = seq[0].latent.shape[0]
    saved = MODEL.attn_processors
    MODEL.set_attn_processor(processor)
    try:
        with torch.no_grad():
            out = MODEL(hidden_states=torch.cat([f.latent for f in seq], dim=2),
                        timestep=timestep[None].expand(batch, -1), encoder_hidden_states=seq[0].text,
                        attention_kwargs={"scale": scales.pop()}, return_dict=False)[0]
    finally:
        MODEL.set_attn_processor(saved)
    rows = [index[id(f)] for f in frames]
    token_rows = torch.tensor([r * FRAME_TOKENS + i for r in rows for i in range(FRAME_TOKENS)])
    kv = [(k[:, token_rows], v[:, token_rows]) for k, v in records]
    for i, f in enumerate(frames):
        tokens = slice(i * FRAME_TOKENS, (i + 1) * FRAME_TOKENS)
        f.kv = [(k[:, tokens], v[:, tokens]) for k, v in kv]
    return out[:, :, rows], kv


# ---------------------------------------------------------------------------------------------- the model
@dataclass
class TagModel:
    batch: int
    scale: float = 1.0  # the LoRA scale the tag was filled at (part of its K/V projection state)
    dtype: torch.dtype = torch.float32
    text_seed: int | None = None  # the conditioning the cross entries hold (None: not filled yet)
    frames: list = field(default_factory=list)  # Frame (evicted ones too) or None (skipped, dropped) per frame
    oldest: int = 0  # rolling engine: the oldest recent frame still held
    allocated: bool = False  # static/rolling: self buffers allocated by the first commit


class CacheModel:
    """What the documented rules say an engine holds. ``window``/``sink`` are None/0 for append-only engines."""

    def __init__(self, kind: str, window: int | None = None, sink: int = 0, kv_dtype: torch.dtype | None = None):
        self.kind, self.window, self.sink, self.kv_dtype = kind, window, sink, kv_dtype
        self.tags: dict[str, TagModel] = {}
        self.resume: dict[str, int] = {}  # rolling: tags skipped forward before their first commit

    def num_frames(self, tag):
        return len(self.tags[tag].frames) if tag in self.tags else self.resume.get(tag, 0)

    def held(self, tag) -> list[Frame]:
        """The frames the engine stores for the tag (append-only: all; rolling: the sink and the ring's)."""
        if tag not in self.tags:
            return []
        frames, n = self.tags[tag].frames, self.num_frames(tag)
        if self.window is None:
            return list(frames)
        return [frames[i] for i in itertools.chain(range(min(self.sink, n)), range(self.tags[tag].oldest, n))]

    def attended(self, tag, chunk: int) -> list[Frame]:
        """The earlier frames a chunk of ``chunk`` frames at the tag's next frame ``n`` attends to, by the rule, not
        by what the engine holds: every one, or for the rolling engine the sink ``[0, min(S, n))`` and the recent
        frames ``[max(S, n - (W - S - c)), n)``, less frames a skip_to skipped or dropped (None). An engine that
        lost a frame the window promises (e.g. a chunk regenerated after a crop into evicted frames) then differs
        from the reference."""
        if tag not in self.tags:
            return []  # nothing committed (maybe skipped forward): nothing to attend to
        frames, n = self.tags[tag].frames, self.num_frames(tag)
        if self.window is None:
            indices = range(n)
        else:
            recent = range(max(self.sink, n - (self.window - self.sink - chunk)), n)
            indices = itertools.chain(range(min(self.sink, n)), recent)
        return [frames[i] for i in indices if frames[i] is not None]

    def forward_error(self, tag, start, chunk, batch, text_seed, scale, dtype) -> tuple[type, str | None] | None:
        """The error a forward must raise, as ``(type, message pattern or None)``, or None. In the engine's order:
        the start frame, what the tag was built with (batch size, dtype, conditioning; ValueError), its K/V
        projection state (another LoRA scale: RuntimeError, stale), the engine's capacity, the RoPE table."""
        state = self.tags.get(tag)
        if start != self.num_frames(tag):
            return ValueError, "start_frame"
        if state is not None:
            if batch != state.batch:
                return ValueError, "was built with batch size"
            if dtype != state.dtype:
                return ValueError, "was built with dtype"
            if text_seed != state.text_seed:
                return ValueError, "other conditioning"
            if scale != state.scale:
                return RuntimeError, "projection weights changed"
        if self.kind == "static" and start + chunk > STATIC_FRAMES:
            return ValueError, None
        if self.window is not None and chunk > self.window - self.sink:
            return ValueError, "does not fit"
        if start + chunk > ROPE_LEN:
            return ValueError, None
        return None

    def commit(self, tag, chunk_frames: list[Frame], batch, text_seed, scale, dtype):
        if tag not in self.tags:
            start = self.resume.pop(tag, 0)
            self.tags[tag] = TagModel(batch, scale, dtype, text_seed, [None] * start, oldest=max(self.sink, start))
        state = self.tags[tag]
        state.frames += chunk_frames
        state.allocated = True
        if self.window is not None:
            state.oldest = max(state.oldest, len(state.frames) - (self.window - self.sink - 1))

    def _crop_targets(self, tag):
        return [tag] if tag is not None else list(self.tags)  # crop() of every tag skips not-yet-committed ones

    def crop_fails(self, keep_arg, tag) -> bool:
        """Out of bounds; or, on a rolling tag that evicted a frame (its oldest held recent frame is past the sink;
        a tag only skipped forward has evicted every frame), ending it between the sink and its last frame: the
        chunk regenerated there could not see its whole window, which the ring no longer holds."""
        for t in self._crop_targets(tag):
            n = self.num_frames(t)
            keep = keep_arg if keep_arg >= 0 else n + keep_arg
            if not 0 <= keep <= n:
                return True
            oldest = self.tags[t].oldest if t in self.tags else n
            if self.window is not None and oldest > self.sink and self.sink < keep < n:
                return True
        return False

    def crop(self, keep_arg, tag):
        for t in self._crop_targets(tag):
            n = self.num_frames(t)
            keep = keep_arg if keep_arg >= 0 else n + keep_arg
            if t not in self.tags:
                if keep == 0:
                    self.resume.pop(t, None)
                continue
            del self.tags[t].frames[keep:]
            if keep <= self.sink:
                self.tags[t].oldest = self.sink

    def skip_fails(self, tag, ahead) -> bool:
        return ahead < 0 or (ahead > 0 and self.num_frames(tag) < self.sink)

    def skip(self, tag, ahead):
        if not ahead:
            return
        frame = self.num_frames(tag) + ahead
        if tag in self.tags:
            # The skipped frames count as committed and evicted; the recent frames before them are dropped too, so
            # no later chunk attends to them (None: never attended), only to the sink.
            state = self.tags[tag]
            state.frames[self.sink:] = [None] * (frame - self.sink)
            state.oldest = frame
        else:
            self.resume[tag] = frame

    def clear(self, tag=None):
        """clear() drops everything of the tag: its frames, conditioning, dtype, LoRA scale, and its skip."""
        for tags in (self.tags, self.resume):
            if tag is None:
                tags.clear()
            else:
                tags.pop(tag, None)

    def memory_bytes(self) -> int:
        """Bytes of the live tags only (a cleared tag holds nothing), in each tag's own dtype, or in fp8: one code
        byte per element plus, per token and head, the bytes spreading its frame's float32 scales (one per group of
        64 tokens) over the frame's tokens (a self frame; the whole text of a cross entry)."""
        def per_head(frame_tokens, state):  # bytes of one token and head
            if self.kv_dtype is None:
                return state.dtype.itemsize * HEAD_DIM
            return HEAD_DIM + math.ceil(4 * math.ceil(frame_tokens / 64) / frame_tokens)

        total = 0
        for state in self.tags.values():
            size = state.batch * 2 * BLOCKS * HEADS  # K and V, per token and byte of a head
            held = {"vanilla": len(state.frames), "static": STATIC_FRAMES * state.allocated,
                    "rolling": (self.window or 0) - 1 if state.allocated else 0}[self.kind]
            # A tag's first commit fills its cross entries too.
            total += size * (held * FRAME_TOKENS * per_head(FRAME_TOKENS, state)
                             + TEXT_LEN * per_head(TEXT_LEN, state) * (state.text_seed is not None))
        return total


# ---------------------------------------------------------------------------------------------- the operations
def _forward(engine, tag, start, x, t, text, store_kv, scale=1.0, dtype=torch.float32):
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16, enabled=dtype == BF16), CausalContext(
            MODEL, start_frame=start, cache_tag=tag, store_kv=store_kv, cache_engines={"main": engine}):
        return MODEL(hidden_states=x, timestep=torch.full((x.shape[0],), t), encoder_hidden_states=text,
                     attention_kwargs={"scale": scale}, return_dict=False)[0]


def _chunk_frames(x, t, start, text, attended, scale, dtype) -> list[Frame]:
    frames = [Frame(x[:, :, i:i + 1], t, start + i, text, scale, dtype) for i in range(x.shape[2])]
    for f in frames:
        f.visible = [*attended, *frames]
    return frames


def _check_state(engine, model: CacheModel):
    assert sorted(engine.tags()) == sorted(model.tags)
    for tag in ALL_TAGS:
        assert engine.num_frames(tag) == model.num_frames(tag)
        assert engine.next_frame(tag) == model.num_frames(tag)
        assert engine.is_cross_init(tag) == (tag in model.tags and model.tags[tag].text_seed is not None)
    assert engine.memory_bytes() == model.memory_bytes()
    for tag, state in model.tags.items():
        held = model.held(tag)
        prefixes = [engine.get_self_prefix(b, tag) for b in range(BLOCKS)]
        if not held:
            assert all(p is None for p in prefixes)
            continue
        kv = [[torch.cat([f.kv[block][i] for f in held], dim=1) for i in (0, 1)] for block in range(BLOCKS)]
        for block, (prefix, (key, value)) in enumerate(zip(prefixes, kv)):
            assert prefix[0].dtype == prefix[1].dtype == state.dtype
            tolerance = _tolerance(state.dtype, engine.kv_dtype, "kv")
            _assert_close(prefix[0], key, state.dtype, f"keys of block {block}, {tag!r}", tolerance)
            _assert_close(prefix[1], value, state.dtype, f"values of block {block}, {tag!r}", tolerance)


class Pass(NamedTuple):
    """A forward's request. A tag's next pass keeps what the tag was built with (LoRA scale, dtype, prompt) unless
    ``change`` names one to change (which must then fail); ``scale``/``dtype`` are those of a tag's first pass."""

    tag: str
    frames: int
    batch: int = 1
    change: str | None = None  # None, "prompt", "scale" or "dtype"
    offset: int = 0  # start frame off the tag's next one
    scale: float = 1.0
    dtype: torch.dtype = torch.float32


def _resolve(model: CacheModel, p: Pass):
    """The text seed, LoRA scale and dtype ``p`` runs with."""
    state = model.tags.get(p.tag)
    text_seed = state.text_seed if state is not None else ALL_TAGS.index(p.tag)
    scale, dtype = (p.scale, p.dtype) if state is None else (state.scale, state.dtype)
    if p.change == "prompt":
        text_seed += 7
    elif p.change == "scale":
        scale = SCALES[1 - SCALES.index(scale)]
    elif p.change == "dtype":
        dtype = torch.float32 if dtype == BF16 else BF16
    return text_seed, scale, dtype


def _operations(tags, clears=1, redos=2, min_size=3):
    """Lists of operations on ``tags``: mostly forwards that succeed; now and then one that must fail (another batch
    size, prompt, LoRA scale, dtype or start frame). A ``redo`` is a crop followed at once by a forward on the same
    tag (the regeneration a crop is for); ``clears`` and ``redos`` weigh those against 4 commits and 2 reads."""
    passes = st.builds(
        Pass, tag=st.sampled_from(tags), frames=st.sampled_from([1, 1, 2, 3]), batch=st.sampled_from([1] * 7 + [2]),
        change=st.sampled_from([None] * 6 + ["prompt", None, None, "scale", None, None, "dtype"]),  # 3 in 13
        offset=st.sampled_from([0] * 14 + [1, -1]), scale=st.sampled_from(SCALES),
        dtype=st.sampled_from([torch.float32] * 2 + [BF16]))
    commit = st.tuples(st.just("commit"), passes, st.sampled_from([0.0, 300.0]))
    read = st.tuples(st.just("read"), passes, st.sampled_from([500.0, 999.0]))
    # Mostly a step or two back (into the window, or refused once the tag evicted), else to the sink or the start.
    redo = st.tuples(st.sampled_from(tags), st.sampled_from([-1, -1, -2, -2, -3, 0, 1, 2]),
                     st.sampled_from([1, 1, 2, 3]), st.sampled_from(["commit", "read"]))
    crop = st.tuples(st.just("crop"), st.sampled_from((*tags, None)), st.integers(-4, 5))
    clear = st.tuples(st.just("clear"), st.sampled_from((*tags, None)))
    fault = st.tuples(st.just("fault"), st.sampled_from(tags), st.integers(1, 3))
    skip = st.tuples(st.just("skip"), st.sampled_from(tags), st.integers(-1, 4))

    def weighted(weight, strategy, to_ops=lambda op: [op]):
        # one_of drops a strategy object it was given before, so each unit of weight needs a new one.
        return [strategy.map(to_ops) for _ in range(weight)]

    ops = st.one_of(
        *weighted(4, commit), *weighted(2, read), *weighted(1, crop), *weighted(clears, clear),
        *weighted(1, fault), *weighted(1, skip),
        *weighted(redos, redo, lambda r: [("crop", r[0], r[1]), (r[3], Pass(r[0], r[2]), 300.0)]),
    )
    return st.lists(ops, min_size=min_size, max_size=18).map(lambda lists: [op for ops_ in lists for op in ops_])


OP_LISTS = _operations(TAGS)


def _run_ops(engine, model: CacheModel, ops):
    MODEL.kv_cache_engines = {"main": engine}  # so that clear_caches(MODEL) clears this engine
    seeds = itertools.count(1000)
    for op in ops:
        before = cache_snapshot_of(engine)
        name = op[0]
        if name in ("commit", "read", "fault"):
            if name == "fault":
                p, t = Pass(op[1], op[2], _batch_of(model, op[1])), 0.0
            else:
                p, t = op[1], op[2]
            text_seed, scale, dtype = _resolve(model, p)
            start = max(model.num_frames(p.tag) + p.offset, 0)
            x, text = _latent(next(seeds), p.batch, p.frames), _text(text_seed, p.batch)
            error = model.forward_error(p.tag, start, p.frames, p.batch, text_seed, scale, dtype)
            if name == "fault" or error:
                FAULT["armed"] = name == "fault"
                expected_error, match = error or (RuntimeError, "injected fault")
                try:
                    with pytest.raises(expected_error, match=match):
                        _forward(engine, p.tag, start, x, t, text, True, scale, dtype)
                finally:
                    FAULT["armed"] = False
                assert_same_snapshot(before, cache_snapshot_of(engine))
                continue
            frames = _chunk_frames(x, t, start, text, model.attended(p.tag, p.frames), scale, dtype)
            out = _forward(engine, p.tag, start, x, t, text, name == "commit", scale, dtype)
            expected, _ = reference(frames)
            assert out.dtype == dtype
            _assert_close(out, expected, dtype, f"{op}", _tolerance(dtype, engine.kv_dtype, "output"))
            if name == "commit":
                model.commit(p.tag, frames, p.batch, text_seed, scale, dtype)
        elif name == "crop":
            tag, keep = op[1], op[2]
            if model.crop_fails(keep, tag):
                with pytest.raises(ValueError):
                    engine.crop(keep, cache_tag=tag)
                assert_same_snapshot(before, cache_snapshot_of(engine))
                continue
            engine.crop(keep, cache_tag=tag)
            model.crop(keep, tag)
        elif name == "clear":
            tag = op[1]
            clear_caches(MODEL) if tag is None else engine.clear(tag)
            model.clear(tag)
        elif name == "skip":
            tag = op[1]
            if model.window is None:
                continue
            frame = model.num_frames(tag) + op[2]
            if model.skip_fails(tag, op[2]):
                with pytest.raises(ValueError):
                    engine.skip_to(frame, tag)
                assert_same_snapshot(before, cache_snapshot_of(engine))
                continue
            engine.skip_to(frame, tag)
            model.skip(tag, op[2])
        _check_state(engine, model)


def _batch_of(model, tag):
    return model.tags[tag].batch if tag in model.tags else 1


def cache_snapshot_of(engine):
    class Holder:
        kv_cache_engines = {"main": engine}
    return cache_snapshot(Holder)


ENGINE_KINDS = {
    "vanilla": lambda: (VanillaKVCacheEngine(), CacheModel("vanilla")),
    "static": lambda: (StaticKVCacheEngine(max_frames=STATIC_FRAMES), CacheModel("static")),
    "rolling": lambda: (RollingKVCacheEngine(4, sink_frames=1), CacheModel("rolling", 4, 1)),
    "vanilla-fp8": lambda: (VanillaKVCacheEngine(kv_dtype=FP8), CacheModel("vanilla", kv_dtype=FP8)),
    "static-fp8": lambda: (StaticKVCacheEngine(max_frames=STATIC_FRAMES, kv_dtype=FP8),
                           CacheModel("static", kv_dtype=FP8)),
    "rolling-fp8": lambda: (RollingKVCacheEngine(4, sink_frames=1, kv_dtype=FP8),
                            CacheModel("rolling", 4, 1, kv_dtype=FP8)),
}


def _commit(tag, frames, t=0.0, **kwargs):
    return "commit", Pass(tag, frames, **kwargs), t


def _read(tag, frames, t=500.0, **kwargs):
    return "read", Pass(tag, frames, **kwargs), t


# Sequences worth running every time: a crop keeps the tag's conditioning (another prompt must still fail), and
# failures and clears between tags of different batch sizes; a tag filled at LoRA scale 0.5 reads right at 0.5 and
# refuses 1.0, then takes 1.0 (and bf16) after a clear.
@pytest.mark.parametrize("kind", ["vanilla", "static"])
@settings(PROPERTY_SETTINGS, max_examples=120)
@given(ops=OP_LISTS)
@example(ops=[_commit("pos", 2), ("crop", "pos", -1), _commit("pos", 1, change="prompt"), _commit("pos", 2)])
@example(ops=[_commit("pos", 3), _commit("neg", 2, batch=2), ("crop", None, -1), ("fault", "neg", 2),
              _commit("neg", 1, batch=1), ("clear", None), _commit("neg", 1, batch=1), _commit("pos", 2, batch=2)])
@example(ops=[_commit("pos", 2, scale=0.5), _read("pos", 1), _commit("pos", 1, change="scale"),
              _read("pos", 1, change="scale"), ("clear", "pos"), _commit("pos", 1), _commit("neg", 1, dtype=BF16),
              _read("neg", 2, change="dtype"), ("clear", None), _commit("neg", 2), _read("neg", 1)])
def test_append_only_engines_follow_the_cache_model(kind, ops):
    engine, model = ENGINE_KINDS[kind]()
    _run_ops(engine, model, ops)


# The same operations on engines storing fp8 (kv_dtype=FP8), to the fp8 tolerances (_tolerance); memory_bytes() is
# the fp8 size (CacheModel.memory_bytes).
@pytest.mark.parametrize("kind", ["vanilla-fp8", "static-fp8", "rolling-fp8"])
@settings(PROPERTY_SETTINGS, max_examples=20)
@given(ops=OP_LISTS)
@example(ops=[_commit("pos", 2), _commit("neg", 1, dtype=BF16), _read("pos", 1), _commit("pos", 2),
              ("crop", "pos", -1), _commit("pos", 1), ("skip", "neg", 2), _read("neg", 1), _commit("pos", 2)])
def test_fp8_engines_follow_the_cache_model(kind, ops):
    engine, model = ENGINE_KINDS[kind]()
    _run_ops(engine, model, ops)


# (window, sink) from the room a chunk has next to the sink (W - S, 1..4) and the sink (0..2): windows of 1..6 frames
# that evict within a few commits, and whose room mostly fits the chunks drawn.
WINDOWS = st.tuples(st.integers(1, 4), st.integers(0, 2)).map(lambda room_sink: (sum(room_sink), room_sink[1]))


# A sink, eviction, a skip past evicted frames, a crop into the sink and a refill; a crop into the evicted frames
# must fail. A crop (and regeneration) before any eviction; after one, a crop that would end the tag past its sink
# must fail (the regenerated chunk would miss frames of its window), also on a tag only skipped forward.
@PROPERTY_SETTINGS
@given(shape=WINDOWS, ops=_operations(TAGS, redos=3, min_size=8))
@example(shape=(4, 1), ops=[_commit("pos", 1), _commit("pos", 2), _commit("pos", 2), ("crop", "pos", 2),
                            ("skip", "pos", 3), _read("pos", 2), ("crop", "pos", 1),
                            _commit("pos", 3, t=300.0), ("skip", "neg", 2), _commit("neg", 1)])
@example(shape=(4, 0), ops=[_commit("pos", 1), _commit("pos", 1), ("crop", "pos", -1), _commit("pos", 1),
                            _commit("pos", 2), ("crop", "pos", -1), _read("pos", 1), ("crop", "pos", 0),
                            _commit("pos", 2), _read("pos", 1), ("clear", "pos"),
                            _commit("pos", 2, scale=0.5, dtype=BF16), _read("pos", 1)])
@example(shape=(3, 0), ops=[("skip", "neg", 3), ("crop", "neg", 1), ("crop", "neg", -1), _commit("neg", 1)])
def test_rolling_engine_follows_the_cache_model(shape, ops):
    window, sink = shape
    engine = RollingKVCacheEngine(window, sink_frames=sink)
    _run_ops(engine, CacheModel("rolling", window, sink), ops)


# Many tags, each filled, read, cropped and cleared a few times: the engine holds exactly the live tags (memory,
# tags()), and a cleared tag refills with any batch size, prompt, LoRA scale or dtype.
@pytest.mark.parametrize("kind", ["rolling", "static", "vanilla"])
@settings(PROPERTY_SETTINGS, max_examples=30)
@given(ops=_operations(CHURN_TAGS, clears=3))
@example(ops=[_commit("req0", 2), _commit("req1", 1, dtype=BF16), ("clear", "req0"), _commit("req2", 1, batch=2),
              _commit("req0", 1, dtype=BF16, scale=0.5), ("clear", "req1"), _read("req1", 1, batch=2),
              ("clear", None), _commit("req1", 2)])
def test_tag_churn_holds_only_live_tags(kind, ops):
    engine, model = ENGINE_KINDS[kind]()
    _run_ops(engine, model, ops)


def test_the_reference_sees_the_lora_scale_and_the_bf16_tolerance_sees_a_missing_frame():
    """The reference forward applies the LoRA layers (they sit in the projections its processor calls) at the
    forward's scale: it equals the stock masked forward at that scale and differs between scales and from the model
    with its adapter off; and attending one frame less moves outputs by more than the bf16 and the (fp32 pass) fp8
    tolerances."""
    text = _text(0, 1)
    x = _latent(1, 1, 3)
    history = _chunk_frames(x[:, :, :2], 0.0, 0, text, [], 0.5, torch.float32)
    chunk = _chunk_frames(x[:, :, 2:], 500.0, 2, text, history, 0.5, torch.float32)
    out, _ = reference(chunk)
    per_token = torch.cat([torch.zeros(1, 2 * FRAME_TOKENS), torch.full((1, FRAME_TOKENS), 500.0)], dim=1)
    runs = {}
    for scale, adapter in ((0.5, True), (1.0, True), (0.5, False)):
        MODEL.enable_adapters() if adapter else MODEL.disable_adapters()
        try:
            with torch.no_grad():
                runs[scale, adapter] = masked_full_forward(
                    MODEL, x, per_token, text, None, block_causal_mask([2, 1], FRAME_TOKENS),
                    attention_kwargs={"scale": scale})[:, :, 2:]
        finally:
            MODEL.enable_adapters()
    torch.testing.assert_close(out, runs[0.5, True], rtol=0, atol=1e-5)
    fewer = _chunk_frames(x[:, :, 2:], 500.0, 2, text, history[1:], 0.5, torch.float32)
    for other in (runs[1.0, True], runs[0.5, False], reference(fewer)[0]):
        for dtype, kv_dtype in ((BF16, None), (torch.float32, FP8)):
            rtol, atol = _tolerance(dtype, kv_dtype, "output") or (BF16_RTOL, BF16_ATOL)
            assert not torch.allclose(other, out, rtol=rtol, atol=atol), (dtype, kv_dtype)


# ---------------------------------------------------------------------------------------------- chunk schedules
SCHEDULES = st.lists(st.integers(1, 4), min_size=1, max_size=5).filter(lambda c: sum(c) <= ROPE_LEN)


@settings(PROPERTY_SETTINGS, max_examples=200)
@given(chunks=SCHEDULES, batch=st.integers(1, 2), data=st.data())
def test_random_chunk_schedules_match_the_masked_full_forward(chunks, batch, data):
    """Denoise every chunk at a random timestep over the cache, commit it clean, and compare each denoising output
    with one stock forward over the whole sequence under the block-causal (or window) mask."""
    kind = data.draw(st.sampled_from(["vanilla", "static", "rolling"]), label="engine")
    window = sink = None
    if kind == "rolling":
        window = data.draw(st.integers(max(chunks), sum(chunks) + 1), label="window")
        sink = data.draw(st.integers(0, window - max(chunks)), label="sink")
        engine = RollingKVCacheEngine(window, sink_frames=sink)
    else:
        engine = VanillaKVCacheEngine() if kind == "vanilla" else StaticKVCacheEngine(max_frames=sum(chunks))
    text = _text(0, batch)
    committed, start = [], 0
    for k, size in enumerate(chunks):
        seen = chunks[:k + 1]
        mask = (block_causal_mask(seen, FRAME_TOKENS) if window is None
                else window_mask(seen, FRAME_TOKENS, window, sink))
        t = data.draw(st.sampled_from([250.0, 999.0]), label=f"timestep {k}")
        x = _latent(10 + k, batch, size)
        out = _forward(engine, "pos", start, x, t, text, store_kv=False)
        per_token = torch.cat([torch.zeros(batch, start * FRAME_TOKENS),
                               torch.full((batch, size * FRAME_TOKENS), t)], dim=1)
        with torch.no_grad():
            ref = masked_full_forward(MODEL, torch.cat([*committed, x], dim=2), per_token, text, None, mask)
        torch.testing.assert_close(out, ref[:, :, start:], rtol=0, atol=1e-5, msg=f"chunk {k} of {chunks}")
        clean = _latent(50 + k, batch, size)
        _forward(engine, "pos", start, clean, 0.0, text, store_kv=True)
        committed.append(clean)
        start += size
    assert engine.num_frames("pos") == sum(chunks)
