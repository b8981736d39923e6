"""A bounded engine for long and streaming rollouts: a sliding window of recent frames plus attention sinks.

``RollingKVCacheEngine(window_frames, sink_frames=0, positions="absolute")``

Window
    A chunk of ``c`` latent frames starting at frame ``s`` attends over at most ``window_frames`` (``W``) frames:

    * the sink, the first ``sink_frames`` (``S``) frames of the rollout, ``[0, min(S, s))``, kept forever;
    * the most recent committed frames, ``[max(S, s - (W - S - c)), s)``;
    * the chunk itself, ``[s, s + c)``.

    So the chunk sees ``S + (W - S - c) + c = W`` frames once the window is full, and simply every earlier frame
    before (the rolling engine then equals the vanilla one). ``W`` need not be a multiple of the chunk size: the
    oldest chunk in the window may be cut. A chunk must fit next to the sink, ``c <= W - S``; this is the
    Self-Forcing ``local_attn_size`` / ``sink_size`` rule, with the sink always attended (as LongLive does).

Self entry payload (:class:`RingEntry`)
    ``keys``/``values``: ``[batch, (W - 1) * frame_tokens, heads, head_dim]`` each, allocated by the tag's first
    commit (when the head shape is first known) and never reallocated: the first ``S`` frames are the sink slots,
    the other ``W - S - 1`` a ring buffer of the most recent frames (a chunk of at least one frame reads at most
    ``W - S - 1`` of them), frame ``f >= S`` living in ring slot ``(f - S) % (W - S - 1)``. The buffers are
    allocated in :meth:`prepare_commit`, the half of a commit that may fail (and then leaves nothing behind). A
    commit writes its frames over the oldest ones in place (through :func:`~.base.writable`, so storage allocated
    under ``torch.inference_mode()`` can be written outside it), so eviction copies one chunk, never the window.
    ``frames`` is the number of frames committed to the tag (evicted ones included); ``oldest`` the oldest recent
    frame still held.

Reads
    Every pass attends over one fresh tensor, ``torch.cat([sink, recent frames in order, chunk])``; grad-enabled
    passes also remember the prefix they read (see :meth:`~BaseKVCacheEngine.attention_kv`), so a commit evicting
    frames between a forward and its ``backward()`` cannot change what a gradient-checkpointing recomputation sees.

Positions
    * ``"absolute"``: keys are cached after RoPE, at the positions they were written with; chunk ``s`` gets the
      positions ``s, s + 1, ...`` and ``rope_max_seq_len`` bounds the rollout, as with the other engines.
    * ``"relative"``: keys are cached before RoPE and the attended frames are numbered ``0, 1, ...`` in window
      order at read time (sink, recent frames, then the chunk's queries and keys), so positions never exceed
      ``W - 1`` and a rollout can run for any number of frames (``W <= rope_max_seq_len`` is required). Without a
      sink this gives exactly the scores of the absolute mode (RoPE scores depend on position differences only);
      with one, the gap between the sink and the recent frames is closed, as in StreamingLLM and LongLive.

``start_frame`` rule
    In both modes a cached pass on a tag starts at the number of frames committed to it so far, evicted frames
    included (the absolute frame index), as with the append-only engines. :meth:`skip_to` moves it forward
    explicitly (re-filling a window after a prompt switch); :meth:`crop` moves it back.

Memory
    :meth:`~BaseKVCacheEngine.memory_bytes` is ``2 x batch x (W - 1) * frame_tokens x heads x head_dim x element
    size`` per block and tag once the tag committed, plus the cross entries: constant however long the rollout.

Errors
    Construction raises ``TypeError``/``ValueError`` for non-integer or non-positive sizes, ``sink_frames >=
    window_frames`` and an unknown ``positions``. :meth:`check_pass` raises ``ValueError`` before any work for a
    chunk larger than ``W - S`` frames and, in relative mode, a window longer than the RoPE table. Cross entries,
    per-tag metadata and the other errors are those of :mod:`diffusers_causal_kv.kv_cache.base`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..positions import apply_rotary_emb
from .base import BaseKVCacheEngine, CrossEntry, TagInfo, writable

if TYPE_CHECKING:
    from ..context import ForwardPass, StagedKV

POSITIONS = ("absolute", "relative")


@dataclass
class RingEntry:
    frame_tokens: int
    frames: int
    oldest: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


class RollingKVCacheEngine(BaseKVCacheEngine):
    """Bounded KV cache: ``sink_frames`` first frames plus a sliding window, ``window_frames`` frames in all.

    Args:
        window_frames: latent frames a chunk's self-attention covers at most, sink and chunk included.
        sink_frames: first frames of the rollout every later chunk keeps attending to.
        positions: ``"absolute"`` (keys keep their RoPE positions) or ``"relative"`` (positions re-indexed inside
            the window at read time, for rollouts of any length).
    """

    def __init__(self, window_frames: int, sink_frames: int = 0, positions: str = "absolute") -> None:
        for name, size in (("window_frames", window_frames), ("sink_frames", sink_frames)):
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{name} must be an int (latent frames), got {type(size).__name__}.")
        if window_frames <= 0:
            raise ValueError(f"window_frames must be positive, got {window_frames}.")
        if sink_frames < 0:
            raise ValueError(f"sink_frames must be >= 0, got {sink_frames}.")
        if sink_frames >= window_frames:
            raise ValueError(
                f"sink_frames={sink_frames} leaves no room in window_frames={window_frames} for the chunk itself; "
                f"use sink_frames < window_frames (e.g. sink_frames={window_frames - 1} at most)."
            )
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}.")
        super().__init__()
        self.window_frames = window_frames
        self.sink_frames = sink_frames
        self.positions = positions
        self._ring_frames = window_frames - sink_frames - 1
        self._resume_at: dict[str, int] = {}  # tags skipped forward before their first commit
        self._rotary: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __repr__(self) -> str:
        state = super().__repr__().split("(", 1)[1]
        return (f"{type(self).__name__}(window_frames={self.window_frames}, sink_frames={self.sink_frames}, "
                f"positions={self.positions!r}, {state}")

    # ------------------------------------------------------------------ state queries
    def num_frames(self, cache_tag: str) -> int:
        """Frames committed to the tag so far, evicted ones included (the tag's next absolute frame index)."""
        info = self._tags.get(cache_tag)
        return self._resume_at.get(cache_tag, 0) if info is None else info.num_frames

    def held_frames(self, cache_tag: str) -> list[range]:
        """The absolute frame indices the tag still holds, in order: the sink frames, then the recent ones."""
        entry = self._any_entry(cache_tag)
        if entry is None:
            return []
        sink, recent = self._held(entry)
        return [r for r in (sink, recent) if len(r)]

    @property
    def reindexes_positions(self) -> bool:
        return self.positions == "relative"

    def rope_start_frame(self, cache_tag: str, start_frame: int, num_frames: int) -> int:
        if self.positions == "absolute":
            return start_frame
        entry = self._any_entry(cache_tag)
        return 0 if entry is None else sum(map(len, self._window(entry, num_frames)))

    # ------------------------------------------------------------------ lifecycle verbs
    def clear(self, cache_tag: str | None = None) -> None:
        """Empty every entry (as :meth:`BaseKVCacheEngine.clear`), or only those of ``cache_tag``: its self frames
        and metadata are dropped and its cross entries zeroed, so its next pass starts at frame 0 with any
        conditioning. The other tags are untouched."""
        if cache_tag is None:
            super().clear()
            self._resume_at.clear()
            return
        for tags in self._cross_kv.values():
            entry = tags.get(cache_tag)
            if entry is not None:
                for t in entry.tensors():
                    with writable(t):
                        t.zero_()
                entry.is_init = False
        for tags in self._self_kv.values():
            tags.pop(cache_tag, None)
        self._tags.pop(cache_tag, None)
        self._resume_at.pop(cache_tag, None)

    def empty_like(self) -> RollingKVCacheEngine:
        """A new, empty engine of this class with this one's window, sink and positions (a subclass taking other
        constructor arguments overrides it)."""
        return type(self)(self.window_frames, self.sink_frames, self.positions)

    def adopt_tag(self, other: RollingKVCacheEngine, cache_tag: str) -> None:
        """Replace ``cache_tag``'s entries by those ``other`` holds (an :meth:`empty_like` engine of the same branch
        that served the same transformer); ``other`` loses them. :func:`~diffusers_causal_kv.streaming.recache` builds
        the new tag there, so a failure part-way leaves this engine untouched."""
        shape = (self.window_frames, self.sink_frames, self.positions)
        if type(other) is not type(self) or (other.window_frames, other.sink_frames, other.positions) != shape or (
                other._module_to_block not in ({}, self._module_to_block)):
            raise ValueError(
                f"adopt_tag() takes the tag of an engine of the same window, sink and positions {shape} that served "
                "the same blocks; build it with empty_like()."
            )
        self.clear(cache_tag)
        for mine, theirs in ((self._self_kv, other._self_kv), (self._cross_kv, other._cross_kv)):
            for block_idx, tags in theirs.items():
                if cache_tag in tags:
                    mine.setdefault(block_idx, {})[cache_tag] = tags.pop(cache_tag)
        for mine, theirs in ((self._tags, other._tags), (self._resume_at, other._resume_at)):
            if cache_tag in theirs:
                mine[cache_tag] = theirs.pop(cache_tag)

    def skip_to(self, frame: int, cache_tag: str) -> None:
        """Continue ``cache_tag`` at absolute frame ``frame`` without committing the frames before it: they count as
        committed and evicted. The sink is kept, the recent frames are dropped. Re-filling the window after a prompt
        switch uses it (commit the sink frames, skip to the oldest recent frame, commit the recent frames)."""
        cached = self.num_frames(cache_tag)
        if isinstance(frame, bool) or not isinstance(frame, int) or frame < cached:
            raise ValueError(
                f"skip_to({frame!r}) on cache tag {cache_tag!r}, which holds {cached} frames: pass a frame index "
                f">= {cached} (use crop() to go back)."
            )
        if frame == cached:
            return
        # Also for a tag cropped to fewer frames than its sink: the sink slots would be read as if committed.
        if cached < self.sink_frames:
            raise ValueError(
                f"cache tag {cache_tag!r} holds {cached} of its {self.sink_frames} sink frames, so skip_to({frame}) "
                "would leave sink frames missing; commit the whole sink first, or clear the tag."
            )
        info = self._tags.get(cache_tag)
        if info is None:
            self._resume_at[cache_tag] = frame
            return
        for tags in self._self_kv.values():
            entry = tags[cache_tag]
            entry.frames = entry.oldest = frame
        info.num_frames = frame

    @contextlib.contextmanager
    def skipping_to(self, frame: int, cache_tag: str):
        """:meth:`skip_to` for the enclosed commits, undone if they raise before committing a frame after it (so a
        :func:`~diffusers_causal_kv.streaming.prefill` whose first chunk fails leaves the tag as it was)."""
        info = self._tags.get(cache_tag)
        num_frames, resume = self.num_frames(cache_tag), self._resume_at.get(cache_tag)
        entries = {block_idx: (tags[cache_tag].frames, tags[cache_tag].oldest)
                   for block_idx, tags in self._self_kv.items() if cache_tag in tags}
        self.skip_to(frame, cache_tag)
        try:
            yield
        except BaseException:
            if self.num_frames(cache_tag) == frame:  # only the skip happened: restore the counters it moved
                if info is not None and cache_tag in self._tags:
                    self._tags[cache_tag].num_frames = num_frames
                for block_idx, (frames, oldest) in entries.items():
                    entry = self._self_kv[block_idx][cache_tag]
                    entry.frames, entry.oldest = frames, oldest
                self._resume_at.pop(cache_tag, None)
                if resume is not None:
                    self._resume_at[cache_tag] = resume
            raise

    def crop(self, num_frames: int, cache_tag: str | None = None) -> None:
        """Keep the first ``num_frames`` committed frames (negative: drop that many newest ones), as
        :meth:`BaseKVCacheEngine.crop`. Only frames still held can become the newest again: the tag may be cropped
        into its sink or to any frame from its oldest held recent frame on, not into the evicted frames between.
        Without ``cache_tag``, tags that were only skipped forward (nothing committed) are left as they are."""
        targets = [cache_tag] if cache_tag is not None else self.tags()
        for tag in targets:
            entry = self._any_entry(tag)
            frames = self.num_frames(tag)
            oldest = frames if entry is None else entry.oldest
            keep = num_frames if num_frames >= 0 else frames + num_frames
            if self.sink_frames < keep < oldest:
                raise ValueError(
                    f"crop({num_frames}) on cache tag {tag!r} would end it at frame {keep}, but frames "
                    f"{self.sink_frames}..{oldest - 1} were evicted from the window; crop to at most "
                    f"{self.sink_frames} or at least {oldest} frames."
                )
        super().crop(num_frames, cache_tag)
        resumed = self._resume_at.get(cache_tag)
        if resumed is not None and num_frames in (0, -resumed):  # a skipped tag without commits, cropped to empty
            del self._resume_at[cache_tag]

    def ensure_capacity(self, cache_tag: str, info: TagInfo, cross_like: dict[int, CrossEntry]) -> None:
        new = cache_tag not in self._tags
        super().ensure_capacity(cache_tag, info, cross_like)
        start = self._resume_at.get(cache_tag, 0) if new else 0  # forgotten at the commit, kept by an abort
        if start:
            self._tags[cache_tag].num_frames = start
            for tags in self._self_kv.values():
                tags[cache_tag].frames = tags[cache_tag].oldest = start

    def commit(self, p: ForwardPass, staged: StagedKV) -> None:
        super().commit(p, staged)
        self._resume_at.pop(p.cache_tag, None)

    # ------------------------------------------------------------------ the pass protocol
    def check_pass(self, p: ForwardPass) -> None:
        super().check_pass(p)
        self._check_chunk(p.num_frames)
        max_len = p.context.transformer.rope.max_seq_len
        if self.positions == "relative" and self.window_frames > max_len:
            raise ValueError(
                f"RollingKVCacheEngine(positions='relative') numbers the window's frames 0..{self.window_frames - 1}, "
                f"but the RoPE table has {max_len} positions (rope_max_seq_len); use window_frames <= {max_len}."
            )

    def check_schedule(self, first_frame: int, sizes: list[int]) -> None:
        self._check_chunk(max(sizes))

    def _check_chunk(self, num_frames: int) -> None:
        room = self.window_frames - self.sink_frames
        if num_frames > room:
            raise ValueError(
                f"chunk of {num_frames} latent frames does not fit RollingKVCacheEngine(window_frames="
                f"{self.window_frames}, sink_frames={self.sink_frames}): a chunk attends to the sink, recent frames "
                f"and itself within the window, so it may have at most {room} frames; use smaller chunks or a "
                "larger window."
            )

    def self_attention_qkv(self, block_idx: int, p: ForwardPass, query, key, value, rotary_emb):
        """``(query, [window | chunk] keys, values)`` for the chunk; the window as defined in the module docstring.

        In relative mode ``rotary_emb`` holds the chunk's positions inside the window (the model layer asks
        :meth:`rope_start_frame`), the chunk is staged before RoPE and the window's keys are rotated here.
        """
        roped_query, roped_key = query, key
        if rotary_emb is not None:
            roped_query, roped_key = apply_rotary_emb(query, *rotary_emb), apply_rotary_emb(key, *rotary_emb)
        if p.store_kv and not p.recomputing:
            staged = key if self.positions == "relative" else roped_key
            p.staged_for(self).self_kv[block_idx] = (staged.detach(), value.detach())
        if self.positions == "absolute" and not torch.is_grad_enabled():  # one copy: window and chunk together
            keys, values = self._window_pieces(block_idx, p)
            if not keys:
                return roped_query, roped_key, value
            return roped_query, torch.cat([*keys, roped_key], dim=1), torch.cat([*values, value], dim=1)
        # Grad-enabled passes remember what they read (nothing, for a tag's first chunk), so a checkpoint
        # recomputation after later commits attends over exactly the same window.
        read = lambda: self._read_window(block_idx, p, rotary_emb)  # noqa: E731
        prefix = p.remembered_prefix(self, block_idx, read) if torch.is_grad_enabled() else read()
        if prefix is None:
            return roped_query, roped_key, value
        return roped_query, torch.cat([prefix[0], roped_key], dim=1), torch.cat([prefix[1], value], dim=1)

    # ------------------------------------------------------------------ window arithmetic
    def _any_entry(self, cache_tag: str) -> RingEntry | None:
        for tags in self._self_kv.values():
            if cache_tag in tags:
                return tags[cache_tag]
        return None

    def _held(self, entry: RingEntry) -> tuple[range, range]:
        return range(min(self.sink_frames, entry.frames)), range(entry.oldest, max(entry.oldest, entry.frames))

    def _window(self, entry: RingEntry, num_frames: int) -> tuple[range, range]:
        """The held frames a chunk of ``num_frames`` frames starting at ``entry.frames`` attends to."""
        sink, recent = self._held(entry)
        reach = max(self.window_frames - self.sink_frames - num_frames, 0)
        return sink, range(max(recent.start, entry.frames - reach), recent.stop)

    def _slices(self, frames: range, entry: RingEntry) -> list[slice]:
        """Token slices of the buffers holding ``frames`` (sink frames, or recent frames that are all held)."""
        tokens = entry.frame_tokens
        if not frames:
            return []
        if frames.stop <= self.sink_frames:
            return [slice(frames.start * tokens, frames.stop * tokens)]
        head = (frames.start - self.sink_frames) % self._ring_frames
        first = min(len(frames), self._ring_frames - head)
        base = self.sink_frames
        parts = [(base + head, base + head + first), (base, base + len(frames) - first)]
        return [slice(a * tokens, b * tokens) for a, b in parts if b > a]

    def _window_pieces(self, block_idx: int, p: ForwardPass):
        """Views of the buffers holding the window of the pass's chunk, in order (empty before the first commit)."""
        entry = self._self_kv.get(block_idx, {}).get(p.cache_tag)
        if entry is None or entry.keys is None:
            return [], []
        slices = [s for frames in self._window(entry, p.num_frames) for s in self._slices(frames, entry)]
        return [entry.keys[:, s] for s in slices], [entry.values[:, s] for s in slices]

    def _read_window(self, block_idx: int, p: ForwardPass, rotary_emb):
        """The chunk's window as fresh tensors; in relative mode its keys rotated to positions ``0, 1, ...``."""
        keys, values = self._window_pieces(block_idx, p)
        if not keys:
            return None
        entry = self._self_kv[block_idx][p.cache_tag]
        key, value = torch.cat(keys, dim=1), torch.cat(values, dim=1)
        if self.positions == "relative" and rotary_emb is not None:
            frames = key.shape[1] // entry.frame_tokens
            key = apply_rotary_emb(key, *_window_rotary(p.context.transformer.rope, rotary_emb, frames,
                                                        entry.frame_tokens))
        return key, value

    # ------------------------------------------------------------------ self payload
    def _self_new_entry(self, info: TagInfo) -> RingEntry:
        return RingEntry(frame_tokens=info.frame_tokens, frames=0, oldest=self.sink_frames)

    def _self_allocate(self, entry: RingEntry, key: torch.Tensor, value: torch.Tensor) -> None:
        if entry.keys is None:
            shape = (key.shape[0], (self.window_frames - 1) * entry.frame_tokens, *key.shape[2:])
            entry.keys, entry.values = key.new_empty(shape), value.new_empty(shape)

    def _self_append(self, entry: RingEntry, key: torch.Tensor, value: torch.Tensor) -> None:
        tokens = entry.frame_tokens
        self._self_allocate(entry, key, value)
        start, stop = entry.frames, entry.frames + key.shape[1] // tokens
        sink = range(start, min(stop, self.sink_frames))
        recent = range(max(start, self.sink_frames, stop - self._ring_frames), stop)
        for frames in (sink, recent):
            offset = (frames.start - start) * tokens
            for dst in self._slices(frames, entry):
                width = dst.stop - dst.start
                with writable(entry.keys):
                    entry.keys[:, dst] = key[:, offset:offset + width]
                    entry.values[:, dst] = value[:, offset:offset + width]
                offset += width
        entry.frames = stop
        entry.oldest = max(entry.oldest, stop - self._ring_frames)

    def _self_prefix(self, entry: RingEntry) -> tuple[torch.Tensor, torch.Tensor] | None:
        slices = [s for frames in self._held(entry) for s in self._slices(frames, entry)]
        if not slices:  # every committed frame evicted (a window of one frame, or right after skip_to)
            return None
        return (torch.cat([entry.keys[:, s] for s in slices], dim=1),
                torch.cat([entry.values[:, s] for s in slices], dim=1))

    def _self_crop(self, entry: RingEntry, keep_tokens: int) -> None:
        entry.frames = keep_tokens // entry.frame_tokens
        if entry.frames <= self.sink_frames:
            entry.oldest = self.sink_frames

    def _self_entry_bytes(self, entry: RingEntry) -> int:
        return 0 if entry.keys is None else entry.keys.nbytes + entry.values.nbytes


def _window_rotary(rope: torch.nn.Module, chunk_rotary, num_frames: int, frame_tokens: int):
    """RoPE tables of window positions ``0..num_frames-1``: the rope module's temporal rows, next to the spatial part
    of the chunk's own tables (the same for every frame of the grid)."""
    tables = []
    for freqs, chunk in zip((rope.freqs_cos, rope.freqs_sin), chunk_rotary):
        temporal = freqs[:num_frames, : rope.t_dim].to(chunk.device, chunk.dtype)
        spatial = chunk[0, :frame_tokens, 0, rope.t_dim:]
        shape = (num_frames, frame_tokens, -1)
        table = torch.cat([temporal[:, None].expand(shape), spatial[None].expand(shape)], dim=-1)
        tables.append(table.reshape(1, num_frames * frame_tokens, 1, -1))
    return tables
