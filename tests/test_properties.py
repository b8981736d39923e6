"""Property-based tests (hypothesis) of the engines, against a plain-Python model of the cache.

The model (:class:`CacheModel`) knows only the documented rules: which frames a tag holds after commits, crops,
clears and skips, which of them a chunk attends to (every held frame, or the rolling engine's sink plus recent
window), which forwards must fail, and how many bytes each engine holds. Every frame ever committed is kept in a
history with the latent, timestep and RoPE position it was committed with and the set of frames it attended to,
so whatever the engine holds can be recomputed from scratch: one stock full-sequence forward over the frames a
chunk depends on, with a frame-level attention mask built from those sets and RoPE tables gathered at the frames'
positions. The engine must agree on its outputs and on the K/V it holds (to 1e-5, fp32); a forward that must fail
raises and leaves the engine exactly as before.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from helpers import assert_same_snapshot, block_causal_mask, cache_snapshot, masked_full_forward, tiny_wan, window_mask
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
)

ROPE_LEN = 16  # a short RoPE table, so sequences run into its end
STATIC_FRAMES = 10
BLOCKS, HEADS, HEAD_DIM, TEXT_LEN = 2, 2, 12, 6
FRAME_TOKENS = 4  # 4x4 latents, patch 2x2
TAGS = ("pos", "neg")
PROPERTY_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MODEL = tiny_wan(layers=BLOCKS, heads=HEADS, head_dim=HEAD_DIM, rope_max_seq_len=ROPE_LEN)
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


# ---------------------------------------------------------------------------------------------- the reference
_SERIALS = itertools.count()


@dataclass(eq=False)
class Frame:
    """One latent frame as it was computed: its input, timestep, RoPE position and the frames it attended to."""

    latent: torch.Tensor  # [batch, channels, 1, h, w]
    timestep: float
    position: int
    text: torch.Tensor
    visible: list = field(default_factory=list)  # Frames, its own chunk included
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
    """Stock attention with a fixed self-attention mask and RoPE tables; records each block's self K/V."""

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
    """Stock forward over ``frames`` and their dependencies: (output of each of ``frames``, per-block self K/V of
    each of ``frames``), each frame's attention restricted to its ``visible`` set."""
    seq = _closure(frames)
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
                        return_dict=False)[0]
    finally:
        MODEL.set_attn_processor(saved)
    rows = [index[id(f)] for f in frames]
    token_rows = torch.tensor([r * FRAME_TOKENS + i for r in rows for i in range(FRAME_TOKENS)])
    kv = [(k[:, token_rows], v[:, token_rows]) for k, v in records]
    return out[:, :, rows], kv


# ---------------------------------------------------------------------------------------------- the model
@dataclass
class TagModel:
    batch: int
    text_seed: int | None = None  # the conditioning the cross entries hold (None: not filled yet)
    frames: list = field(default_factory=list)  # Frame or None (evicted / skipped) per absolute index
    oldest: int = 0  # rolling engine: the oldest recent frame still held
    allocated: bool = False  # static/rolling: self buffers allocated by the first commit


class CacheModel:
    """What the documented rules say an engine holds. ``window``/``sink`` are None/0 for append-only engines."""

    def __init__(self, kind: str, window: int | None = None, sink: int = 0):
        self.kind, self.window, self.sink = kind, window, sink
        self.tags: dict[str, TagModel] = {}
        self.resume: dict[str, int] = {}  # rolling: tags skipped forward before their first commit

    def num_frames(self, tag):
        return len(self.tags[tag].frames) if tag in self.tags else self.resume.get(tag, 0)

    def held(self, tag) -> list[Frame]:
        if tag not in self.tags:
            return []
        frames, n = self.tags[tag].frames, self.num_frames(tag)
        if self.window is None:
            return list(frames)
        return [frames[i] for i in itertools.chain(range(min(self.sink, n)), range(self.tags[tag].oldest, n))]

    def attended(self, tag, chunk: int) -> list[Frame]:
        """The held frames a chunk of ``chunk`` frames at the tag's next frame attends to."""
        if self.window is None or tag not in self.tags:
            return self.held(tag)
        n, state = self.num_frames(tag), self.tags[tag]
        recent = range(max(state.oldest, self.sink, n - (self.window - self.sink - chunk)), n)
        return [state.frames[i] for i in itertools.chain(range(min(self.sink, n)), recent)]

    def forward_fails(self, tag, start, chunk, batch, text_seed) -> bool:
        state = self.tags.get(tag)
        if start != self.num_frames(tag) or start + chunk > ROPE_LEN:
            return True
        if state is not None and (batch != state.batch
                                  or state.text_seed is not None and text_seed != state.text_seed):
            return True
        if self.kind == "static" and start + chunk > STATIC_FRAMES:
            return True
        return self.window is not None and chunk > self.window - self.sink

    def commit(self, tag, chunk_frames: list[Frame], batch, text_seed):
        if tag not in self.tags:
            start = self.resume.pop(tag, 0)
            self.tags[tag] = TagModel(batch, frames=[None] * start, oldest=max(self.sink, start))
        state = self.tags[tag]
        state.text_seed = text_seed if state.text_seed is None else state.text_seed
        state.frames += chunk_frames
        state.allocated = True
        if self.window is not None:
            state.oldest = max(state.oldest, len(state.frames) - (self.window - self.sink - 1))

    def _crop_targets(self, tag):
        return [tag] if tag is not None else list(self.tags)  # crop() of every tag skips not-yet-committed ones

    def crop_fails(self, keep_arg, tag) -> bool:
        for t in self._crop_targets(tag):
            n = self.num_frames(t)
            keep = keep_arg if keep_arg >= 0 else n + keep_arg
            oldest = self.tags[t].oldest if t in self.tags else n
            if not 0 <= keep <= n or (self.window is not None and self.sink < keep < oldest):
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
            self.tags[tag].frames += [None] * ahead  # counted as committed, evicted
            self.tags[tag].oldest = frame
        else:
            self.resume[tag] = frame

    def clear(self, tag=None):
        for tags in (self.tags, self.resume):
            if tag is None:
                tags.clear()
            else:
                tags.pop(tag, None)

    def memory_bytes(self) -> int:
        frame = BLOCKS * 2 * FRAME_TOKENS * HEADS * HEAD_DIM * 4  # K and V of one frame per batch element
        cross = BLOCKS * 2 * TEXT_LEN * HEADS * HEAD_DIM * 4
        # A tag's first commit fills its cross entries; clear() drops them with the tag (the engine holds nothing).
        total = sum(state.batch * cross for state in self.tags.values() if state.text_seed is not None)
        for state in self.tags.values():
            held = {"vanilla": len(state.frames), "static": STATIC_FRAMES * state.allocated,
                    "rolling": (self.window or 0) - 1 if state.allocated else 0}[self.kind]
            total += state.batch * held * frame
        return total


# ---------------------------------------------------------------------------------------------- the operations
def _forward(engine, tag, start, x, t, text, store_kv):
    with torch.no_grad(), CausalContext(MODEL, start_frame=start, cache_tag=tag, store_kv=store_kv,
                                        cache_engines={"main": engine}):
        return MODEL(hidden_states=x, timestep=torch.full((x.shape[0],), t), encoder_hidden_states=text,
                     return_dict=False)[0]


def _chunk_frames(x, t, start, text, attended) -> list[Frame]:
    frames = [Frame(x[:, :, i:i + 1], t, start + i, text) for i in range(x.shape[2])]
    for f in frames:
        f.visible = [*attended, *frames]
    return frames


def _check_state(engine, model: CacheModel):
    assert sorted(engine.tags()) == sorted(model.tags)
    for tag in TAGS:
        assert engine.num_frames(tag) == model.num_frames(tag)
        assert engine.next_frame(tag) == model.num_frames(tag)
        assert engine.is_cross_init(tag) == (tag in model.tags and model.tags[tag].text_seed is not None)
    assert engine.memory_bytes() == model.memory_bytes()
    for tag in model.tags:
        held = model.held(tag)
        prefixes = [engine.get_self_prefix(b, tag) for b in range(BLOCKS)]
        if not held:
            assert all(p is None for p in prefixes)
            continue
        _, kv = reference(held)
        for block, (prefix, (key, value)) in enumerate(zip(prefixes, kv)):
            torch.testing.assert_close(prefix[0], key, rtol=0, atol=1e-5, msg=f"keys of block {block}, {tag!r}")
            torch.testing.assert_close(prefix[1], value, rtol=0, atol=1e-5, msg=f"values of block {block}")


# Mostly forwards that succeed; now and then one that must fail (another batch size, prompt or start frame).
_RARELY = st.sampled_from([0] * 7 + [1])
_FORWARD = st.tuples(st.sampled_from(TAGS), st.integers(1, 3), st.sampled_from([1] * 7 + [2]), _RARELY,
                     st.sampled_from([0] * 14 + [1, -1]))
OPS = st.one_of(
    *[st.tuples(st.just("commit"), _FORWARD, st.sampled_from([0.0, 300.0]))] * 4,
    *[st.tuples(st.just("read"), _FORWARD, st.sampled_from([500.0, 999.0]))] * 2,
    st.tuples(st.just("crop"), st.sampled_from((*TAGS, None)), st.integers(-4, 5)),
    st.tuples(st.just("clear"), st.sampled_from((*TAGS, None))),
    st.tuples(st.just("fault"), st.sampled_from(TAGS), st.integers(1, 3)),
    st.tuples(st.just("skip"), st.sampled_from(TAGS), st.integers(-1, 4)),
)
OP_LISTS = st.lists(OPS, min_size=4, max_size=24)


def _run_ops(engine, model: CacheModel, ops):
    seeds = itertools.count(1000)
    for op in ops:
        before = cache_snapshot_of(engine)
        name = op[0]
        if name in ("commit", "read", "fault"):
            if name == "fault":
                tag, chunk, t, batch, prompt, offset = op[1], op[2], 0.0, _batch_of(model, op[1]), 0, 0
            else:
                (tag, chunk, batch, prompt, offset), t = op[1], op[2]
            state = model.tags.get(tag)
            text_seed = (state.text_seed if state and state.text_seed is not None else TAGS.index(tag)) + 7 * prompt
            start = max(model.num_frames(tag) + offset, 0)
            x, text = _latent(next(seeds), batch, chunk), _text(text_seed, batch)
            fails = model.forward_fails(tag, start, chunk, batch, text_seed)
            if name == "fault" or fails:
                FAULT["armed"] = name == "fault"
                try:
                    with pytest.raises(RuntimeError if name == "fault" and not fails else ValueError):
                        _forward(engine, tag, start, x, t, text, store_kv=True)
                finally:
                    FAULT["armed"] = False
                assert_same_snapshot(before, cache_snapshot_of(engine))
                continue
            attended = model.attended(tag, chunk)
            frames = _chunk_frames(x, t, start, text, attended)
            out = _forward(engine, tag, start, x, t, text, store_kv=name == "commit")
            expected, _ = reference(frames)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-5, msg=f"{op}")
            if name == "commit":
                model.commit(tag, frames, batch, text_seed)
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
            if model.window is None:
                tag = None  # append-only engines clear everything
            engine.clear() if tag is None else engine.clear(tag)
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
}


def _commit(tag, frames, batch=1, prompt=0, offset=0, t=0.0):
    return "commit", (tag, frames, batch, prompt, offset), t


# Sequences worth running every time: a crop keeps the tag's conditioning (another prompt must still fail), and
# failures and clears between tags of different batch sizes.
@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
@PROPERTY_SETTINGS
@given(ops=OP_LISTS)
@example(ops=[_commit("pos", 2), ("crop", "pos", -1), _commit("pos", 1, prompt=1), _commit("pos", 2)])
@example(ops=[_commit("pos", 3), _commit("neg", 2, batch=2), ("crop", None, -1), ("fault", "neg", 2),
              _commit("neg", 1, batch=1), ("clear", None), _commit("neg", 1, batch=1), _commit("pos", 2, batch=2)])
def test_append_only_engines_follow_the_cache_model(kind, ops):
    engine, model = ENGINE_KINDS[kind]()
    _run_ops(engine, model, ops)


WINDOWS = st.integers(1, 6).flatmap(lambda window: st.tuples(st.just(window), st.integers(0, window - 1)))


# A sink, eviction, a skip past evicted frames, a crop into the sink and a refill; a crop into the evicted frames
# must fail.
@PROPERTY_SETTINGS
@given(shape=WINDOWS, ops=OP_LISTS)
@example(shape=(4, 1), ops=[_commit("pos", 1), _commit("pos", 2), _commit("pos", 2), ("crop", "pos", 2),
                            ("skip", "pos", 3), ("read", ("pos", 2, 1, 0, 0), 500.0), ("crop", "pos", 1),
                            _commit("pos", 3, t=300.0), ("skip", "neg", 2), _commit("neg", 1)])
def test_rolling_engine_follows_the_cache_model(shape, ops):
    window, sink = shape
    engine = RollingKVCacheEngine(window, sink_frames=sink)
    _run_ops(engine, CacheModel("rolling", window, sink), ops)


# ---------------------------------------------------------------------------------------------- chunk schedules
SCHEDULES = st.lists(st.integers(1, 4), min_size=1, max_size=5).filter(lambda c: sum(c) <= ROPE_LEN)


@PROPERTY_SETTINGS
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
