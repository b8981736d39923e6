"""A bounded engine for long and streaming rollouts: a sliding window of recent frames plus attention sinks.

``RollingKVCacheEngine(window_frames, sink_frames=0, positions="absolute", kv_dtype=None)``

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
    passes also remember the prefix they read (see :meth:`~BaseKVCacheEngine.update`), so a commit evicting
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
    chunk larger than ``W - S`` frames and, in relative mode, :meth:`check_rope_table` a window longer than the RoPE
    table. Cross entries,
    per-tag metadata and the other errors are those of :mod:`diffusers_causal_kv.kv_cache.base`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .base import BaseKVCacheEngine, writable
from .records import PassInfo, StagedChunk, TagInfo

POSITIONS = ("absolute", "relative")


@dataclass
class RingEntry:
    frame_tokens: int
    frames: int
    oldest: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    pass_slices: tuple | None = None
    """``(chunk_frames, token slices, token index)`` the pass in flight reads, set by
    :meth:`RollingKVCacheEngine.check_pass` outside compiled code, so that compiled attention never reads the frame
    counters (which grow every chunk and would recompile it). Compiled code reads through the index, a device tensor
    of the window's token positions in the buffers: its length is the same from chunk to chunk once the window is
    full, whatever the ring's phase, so one graph serves every chunk (slices would bake the phase into the graph).
    Dropped whenever ``frames`` or ``oldest`` change."""

    def __setattr__(self, name, value):
        if name in ("frames", "oldest"):
            object.__setattr__(self, "pass_slices", None)
        object.__setattr__(self, name, value)


class RollingKVCacheEngine(BaseKVCacheEngine):
    """Bounded KV cache: ``sink_frames`` first frames plus a sliding window, ``window_frames`` frames in all.

    Args:
        window_frames: latent frames a chunk's self-attention covers at most, sink and chunk included.
        sink_frames: first frames of the rollout every later chunk keeps attending to.
        positions: ``"absolute"`` (keys keep their RoPE positions) or ``"relative"`` (positions re-indexed inside
            the window at read time, for rollouts of any length).
        kv_dtype: ``None`` (K/V stored as computed) or ``torch.float8_e4m3fn`` (fp8 with scales, see
            :mod:`~diffusers_causal_kv.kv_cache.quantized`).
    """

    supports_refill = True

    def __init__(self, window_frames: int, sink_frames: int = 0, positions: str = "absolute",
                 kv_dtype: torch.dtype | None = None) -> None:
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
        super().__init__(kv_dtype)
        self.window_frames = window_frames
        self.sink_frames = sink_frames
        self.positions = positions
        self._ring_frames = window_frames - sink_frames - 1
        self._resume_at: dict[str, int] = {}  # tags skipped forward before their first commit
        # token indices per (slices, device): as many as the ring has phases and the window fill states
        self._token_indices: dict[tuple, torch.Tensor] = {}

    def __repr__(self) -> str:
        state = super().__repr__().split("(", 1)[1]
        return (f"{type(self).__name__}(window_frames={self.window_frames}, sink_frames={self.sink_frames}, "
                f"positions={self.positions!r}, {state}")

    @property
    def reindexes_positions(self) -> bool:
        """True in relative mode: keys cached before RoPE, the window numbered ``0, 1, ...`` at read time."""
        return self.positions == "relative"

    # ------------------------------------------------------------------ state queries
    def num_frames(self, cache_tag: str) -> int:
        """Frames committed to the tag so far, evicted ones included (the tag's next absolute frame index)."""
        info = self._tags.get(cache_tag)
        return self._resume_at.get(cache_tag, 0) if info is None else info.committed_frames

    def held_frames(self, cache_tag: str) -> list[range]:
        """The absolute frame indices the tag still holds, in order: the sink frames, then the recent ones."""
        entry = self._any_entry(cache_tag)
        return [] if entry is None else [r for r in self._held(entry) if len(r)]

    # ------------------------------------------------------------------ checks
    def check_pass(self, info: PassInfo) -> None:
        """The base checks, then that the chunk fits next to the sink (``chunk_frames <= W - S``)."""
        super().check_pass(info)
        self._check_chunk(info.chunk_frames)
        read = {}  # every block of a tag holds the same frames: work the window out once per layout
        for entries in self._self_kv.values():
            entry = entries.get(info.cache_tag)
            if entry is not None and entry.keys is not None:
                layout = (entry.frames, entry.oldest, entry.frame_tokens, entry.keys.device)
                if layout not in read:
                    slices = self._window_slices(entry, info.chunk_frames)
                    read[layout] = (info.chunk_frames, slices, self._token_index(slices, entry.keys.device))
                entry.pass_slices = read[layout]

    def check_schedule(self, first_frame: int, sizes: list[int]) -> None:
        """Every chunk of the schedule must fit next to the sink (``size <= W - S``)."""
        self._check_chunk(max(sizes))

    def check_rope_table(self, positions: int) -> None:
        """Relative mode numbers the window's frames ``0..W-1``: the model's RoPE table must have that many."""
        if self.positions == "relative" and self.window_frames > positions:
            raise ValueError(
                f"RollingKVCacheEngine(positions='relative') numbers the window's frames 0..{self.window_frames - 1}, "
                f"but the RoPE table has {positions} positions (rope_max_seq_len); use window_frames <= {positions}."
            )

    def _check_chunk(self, chunk_frames: int) -> None:
        room = self.window_frames - self.sink_frames
        if chunk_frames > room:
            raise ValueError(
                f"chunk of {chunk_frames} latent frames does not fit RollingKVCacheEngine(window_frames="
                f"{self.window_frames}, sink_frames={self.sink_frames}): a chunk attends to the sink, recent frames "
                f"and itself within the window, so it may have at most {room} frames; use smaller chunks or a "
                "larger window."
            )

    def _check_crop(self, cache_tag: str, keep: int, num_frames: int) -> None:
        """The chunk regenerated after a crop must see its whole window, but the ring holds only the ``W - S - 1``
        most recent frames: once the tag evicted a frame, it may be cropped into its sink only."""
        entry = self._any_entry(cache_tag)
        committed = self.num_frames(cache_tag)
        oldest = committed if entry is None else entry.oldest  # a tag only skipped forward holds no recent frame
        if oldest > self.sink_frames and self.sink_frames < keep < committed:
            raise ValueError(
                f"crop({num_frames}) on cache tag {cache_tag!r} would end it at frame {keep}, but frames "
                f"{self.sink_frames}..{oldest - 1} were evicted from the window, so a chunk regenerated there "
                f"could not see its whole window; crop to at most {self.sink_frames} frames (the sink) or clear the "
                "tag."
            )

    # ------------------------------------------------------------------ verbs of bounded, streaming rollouts
    def clear(self, cache_tag: str | None = None) -> None:
        """As :meth:`BaseKVCacheEngine.clear`, forgetting a pending :meth:`skip_to` of the cleared tags too."""
        super().clear(cache_tag)
        if cache_tag is None:
            self._resume_at.clear()
        else:
            self._resume_at.pop(cache_tag, None)

    def crop(self, num_frames: int, cache_tag: str | None = None) -> None:
        """As :meth:`BaseKVCacheEngine.crop`, within the frames still held (see :meth:`_check_crop`). Without
        ``cache_tag``, tags that were only skipped forward (nothing committed) are left as they are."""
        super().crop(num_frames, cache_tag)
        resumed = self._resume_at.get(cache_tag)
        if resumed is not None and num_frames in (0, -resumed):  # a skipped tag without commits, cropped to empty
            del self._resume_at[cache_tag]

    def empty_like(self) -> RollingKVCacheEngine:
        """A new, empty engine of this class with this one's window, sink, positions and ``kv_dtype`` (a subclass
        taking other constructor arguments overrides it)."""
        return type(self)(self.window_frames, self.sink_frames, self.positions, kv_dtype=self.kv_dtype)

    def adopt_tag(self, other: RollingKVCacheEngine, cache_tag: str) -> None:
        """Replace ``cache_tag``'s entries by those ``other`` holds (an :meth:`empty_like` engine of the same branch
        that served the same transformer); ``other`` loses them. :func:`~diffusers_causal_kv.refill.recache` builds
        the new tag there, so a failure part-way leaves this engine untouched."""
        shape = (self.window_frames, self.sink_frames, self.positions)
        if type(other) is not type(self) or (other.window_frames, other.sink_frames, other.positions) != shape or (
                other.kv_dtype != self.kv_dtype or other._module_to_block not in ({}, self._module_to_block)):
            raise ValueError(
                f"adopt_tag() takes the tag of an engine of the same window, sink and positions {shape} and kv_dtype "
                f"{self.kv_dtype} that served the same blocks; build it with empty_like()."
            )
        self.clear(cache_tag)
        for mine, theirs in ((self._self_kv, other._self_kv), (self._cross_kv, other._cross_kv)):
            for block_idx, tags in theirs.items():
                if cache_tag in tags:
                    mine.setdefault(block_idx, {})[cache_tag] = tags.pop(cache_tag)
        for mine, theirs in ((self._tags, other._tags), (self._resume_at, other._resume_at)):
            if cache_tag in theirs:
                mine[cache_tag] = theirs.pop(cache_tag)
        self._stamp(cache_tag)
        other._stamp(cache_tag)

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
        self._stamp(cache_tag)  # checked: the tag moves now
        info = self._tags.get(cache_tag)
        if info is None:
            self._resume_at[cache_tag] = frame
            return
        for tags in self._self_kv.values():
            entry = tags[cache_tag]
            entry.frames = entry.oldest = frame
        info.committed_frames = frame

    @contextlib.contextmanager
    def skipping_to(self, frame: int, cache_tag: str):
        """:meth:`skip_to` for the enclosed commits, undone if they raise before committing a frame after it (so a
        :func:`~diffusers_causal_kv.refill.prefill` whose first chunk fails leaves the tag as it was)."""
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
                    self._tags[cache_tag].committed_frames = num_frames
                for block_idx, (frames, oldest) in entries.items():
                    entry = self._self_kv[block_idx][cache_tag]
                    entry.frames, entry.oldest = frames, oldest
                self._resume_at.pop(cache_tag, None)
                if resume is not None:
                    self._resume_at[cache_tag] = resume
                self._stamp(cache_tag)
            raise

    def prepare_commit(self, info: PassInfo, staged: StagedChunk) -> bool:
        """As :meth:`BaseKVCacheEngine.prepare_commit`; a tag created after a :meth:`skip_to` starts at the skipped-to
        frame."""
        created = super().prepare_commit(info, staged)
        start = self._resume_at.get(info.cache_tag, 0) if created else 0  # forgotten at the commit, kept by an abort
        if start:
            self._tags[info.cache_tag].committed_frames = start
            for tags in self._self_kv.values():
                tags[info.cache_tag].frames = tags[info.cache_tag].oldest = start
        return created

    def commit(self, info: PassInfo, staged: StagedChunk) -> None:
        """As :meth:`BaseKVCacheEngine.commit`; the tag's pending :meth:`skip_to` is used up."""
        super().commit(info, staged)
        self._resume_at.pop(info.cache_tag, None)

    # ------------------------------------------------------------------ window arithmetic
    def _held(self, entry: RingEntry) -> tuple[range, range]:
        return range(min(self.sink_frames, entry.frames)), range(entry.oldest, max(entry.oldest, entry.frames))

    def _window(self, entry: RingEntry, chunk_frames: int) -> tuple[range, range]:
        """The held frames a chunk of ``chunk_frames`` frames starting at ``entry.frames`` attends to."""
        sink, recent = self._held(entry)
        reach = max(self.window_frames - self.sink_frames - chunk_frames, 0)
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

    # ------------------------------------------------------------------ storage
    def _new_entry(self, info: TagInfo) -> RingEntry:
        return RingEntry(frame_tokens=info.frame_tokens, frames=0, oldest=self.sink_frames)

    def _allocate(self, entry: RingEntry, key: torch.Tensor, value: torch.Tensor) -> None:
        if entry.keys is None:
            shape = (key.shape[0], (self.window_frames - 1) * entry.frame_tokens, *key.shape[2:])
            entry.keys, entry.values = key.new_empty(shape), value.new_empty(shape)

    def _write(self, entry: RingEntry, key: torch.Tensor, value: torch.Tensor) -> None:
        tokens = entry.frame_tokens
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

    def _window_slices(self, entry: RingEntry, chunk_frames: int) -> tuple[slice, ...]:
        return tuple(s for frames in self._window(entry, chunk_frames) for s in self._slices(frames, entry))

    def _token_index(self, slices: tuple[slice, ...], device: torch.device) -> torch.Tensor | None:
        """The token positions of ``slices`` in order, on ``device`` (built there: no host-device copy)."""
        if not slices:
            return None
        key = (tuple((s.start, s.stop) for s in slices), device)
        if key not in self._token_indices:
            self._token_indices[key] = torch.cat([torch.arange(s.start, s.stop, device=device) for s in slices])
        return self._token_indices[key]

    def _pieces(self, entry: RingEntry, chunk_frames: int):
        if entry.keys is None:
            return [], []
        known = entry.pass_slices
        if known is None or known[0] != chunk_frames:
            return self._views(entry, self._window_slices(entry, chunk_frames))
        if known[2] is not None and torch.compiler.is_compiling():
            # One gather of fixed length instead of views whose bounds depend on the ring's phase (see RingEntry).
            return [entry.keys.index_select(1, known[2])], [entry.values.index_select(1, known[2])]
        return self._views(entry, known[1])

    @staticmethod
    def _views(entry: RingEntry, slices: tuple[slice, ...]):
        return [entry.keys[:, s] for s in slices], [entry.values[:, s] for s in slices]

    def _crop_entry(self, entry: RingEntry, keep_frames: int) -> None:
        entry.frames = keep_frames
        if entry.frames <= self.sink_frames:
            entry.oldest = self.sink_frames

    def _entry_bytes(self, entry: RingEntry) -> int:
        return 0 if entry.keys is None else entry.keys.nbytes + entry.values.nbytes
