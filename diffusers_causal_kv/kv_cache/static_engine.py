"""A zero-copy engine: each block's self K/V live in one preallocated buffer per tag, read as views.

Self entry payload (:class:`StaticBuffers`)
    ``keys``/``values``: ``[batch, max_frames * frame_tokens, heads, head_dim]`` each, allocated (uninitialised) by
    the tag's first commit, when the head shape is first known; ``len``, the number of committed tokens; ``capacity``,
    the allocated tokens. Only ``[:, :len]`` holds committed K/V: what lies after it is scratch.

Reads and writes
    * No-grad passes on a tag that has buffers write the current chunk's K/V in place right after the committed
      prefix (``[:, len:len + chunk]``) and attend over the view ``[:, :len + chunk]``: no concatenation and no copy
      of the prefix. The write does not advance ``len``; only the commit of a ``store_kv=True`` forward does, and
      since that forward already wrote its chunk in place, the commit copies nothing.
    * Grad-enabled passes attend over fresh tensors (a clone of the prefix concatenated with the chunk), so no view
      that a live autograd graph saved is overwritten by a later write, commit or crop.
    * The first chunk of a tag attends over its own K/V; its commit allocates the buffers (in the prepare phase,
      so an out-of-memory leaves nothing behind) and copies it in.

    The views of a pass are prepared by :meth:`StaticKVCacheEngine.check_pass`, outside the transformer blocks: code
    compiled with ``torch.compile`` then only sees tensors whose shapes change per chunk (one dynamic-shape
    recompile), never the Python integers of the bookkeeping (which would recompile for every chunk).

``start_frame`` rule
    Append-only, as the vanilla engine: a cached pass on a tag starts at the number of frames the tag holds.

Capacity
    A pass whose chunk would end after ``max_frames`` raises ``ValueError`` in :meth:`check_pass`, before any work,
    naming the frames needed. :meth:`~BaseKVCacheEngine.crop` only moves ``len`` (the memory stays allocated);
    :meth:`~BaseKVCacheEngine.clear` frees the buffers.

Memory
    :meth:`~BaseKVCacheEngine.memory_bytes` counts the allocated buffers: ``2 x batch x max_frames * frame_tokens x
    heads x head_dim x element size`` per block and tag once the tag committed, plus the cross entries.

fp8 storage (``kv_dtype``)
    The buffers hold the fp8 format of :mod:`~diffusers_causal_kv.kv_cache.quantized` (their last axis grows by the
    scale bytes); no-grad passes then attend over a dequantized copy of the prefix with the chunk appended, as the
    vanilla engine does, and commits write the encoded chunk into the buffers.

Cross entries, per-tag metadata and the other errors are those of :mod:`diffusers_causal_kv.kv_cache.base`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BaseKVCacheEngine, writable
from .records import AttentionKV, PassInfo, TagInfo


@dataclass
class StaticBuffers:
    capacity: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    len: int = 0


class StaticKVCacheEngine(BaseKVCacheEngine):
    """Append-only KV cache of at most ``max_frames`` latent frames per tag, in preallocated buffers."""

    def __init__(self, max_frames: int, kv_dtype: torch.dtype | None = None) -> None:
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames <= 0:
            raise ValueError(f"max_frames must be a positive int (latent frames per tag), got {max_frames!r}.")
        super().__init__(kv_dtype)
        self.max_frames = max_frames
        # Per tag and block, the view [:, :len + chunk] of the buffers for the pass in flight (the chunk at its end).
        self._pass_views: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def empty_like(self) -> StaticKVCacheEngine:
        """A new, empty engine with this one's ``max_frames`` and ``kv_dtype``."""
        return type(self)(self.max_frames, kv_dtype=self.kv_dtype)

    def check_pass(self, info: PassInfo) -> None:
        """The base checks, the capacity check, then the views the pass writes and reads (no state changes)."""
        super().check_pass(info)
        self._check_capacity(info.start_frame, info.chunk_frames)
        self._pass_views.pop(info.cache_tag, None)
        if info.grad_enabled or self.kv_dtype is not None:  # fp8 buffers are read through dequantized copies
            return
        end_offset = info.chunk_frames * info.frame_tokens
        views = {}
        for block_idx, tags in self._self_kv.items():
            entry = tags.get(info.cache_tag)
            if entry is None or entry.keys is None:
                return
            if entry.keys.is_inference() and not torch.is_inference_mode_enabled():
                # Buffers allocated under torch.inference_mode() cannot be written in place outside it, and the write
                # runs inside the blocks (maybe compiled, where no mode switch can be traced): move them out once.
                entry.keys, entry.values = entry.keys.clone(), entry.values.clone()
            end = entry.len + end_offset
            views[block_idx] = (entry.keys[:, :end], entry.values[:, :end])
        if views:
            self._pass_views[info.cache_tag] = views

    def check_schedule(self, first_frame: int, sizes: list[int]) -> None:
        """The whole schedule must end within ``max_frames``."""
        self._check_capacity(first_frame + sum(sizes[:-1]), sizes[-1])

    def _check_capacity(self, start_frame: int, chunk_frames: int) -> None:
        end_frame = start_frame + chunk_frames
        if end_frame > self.max_frames:
            raise ValueError(
                f"chunk covers latent frames {start_frame}..{end_frame - 1} but this StaticKVCacheEngine holds at "
                f"most {self.max_frames} frames per tag; build it with StaticKVCacheEngine(max_frames={end_frame}) "
                "or more, shorten the rollout, or use a rolling engine."
            )

    def _attend_no_grad(self, block_idx, info, chunk_key, value, stored_key, rotary) -> AttentionKV:
        """Write the chunk in place after the prefix and attend over views of the buffers (the tag's first chunk,
        which has no buffers yet, attends over itself)."""
        views = self._pass_views.get(info.cache_tag)
        if views is None:
            return super()._attend_no_grad(block_idx, info, chunk_key, value, stored_key, rotary)
        keys, values = views[block_idx]
        # Sliced from the end of the one view, so compiled code sees one input per buffer and no Python offsets.
        new_keys, new_values = keys[:, -chunk_key.shape[1]:], values[:, -chunk_key.shape[1]:]
        new_keys.copy_(chunk_key)
        new_values.copy_(value)
        return AttentionKV(keys, values, new_keys, new_values)

    def clear(self, cache_tag: str | None = None) -> None:
        """As :meth:`BaseKVCacheEngine.clear`: the cleared tags' buffers are freed."""
        super().clear(cache_tag)
        self._pass_views.clear()

    def crop(self, num_frames: int, cache_tag: str | None = None) -> None:
        """As :meth:`BaseKVCacheEngine.crop`: only the committed length moves; the buffers stay allocated."""
        super().crop(num_frames, cache_tag)
        self._pass_views.clear()

    # ------------------------------------------------------------------ storage
    def _new_entry(self, info: TagInfo) -> StaticBuffers:
        return StaticBuffers(capacity=self.max_frames * info.frame_tokens)

    def _allocate(self, entry: StaticBuffers, key: torch.Tensor, value: torch.Tensor) -> None:
        if entry.keys is None:  # the tag's first commit, in its prepare phase
            shape = (key.shape[0], entry.capacity, *key.shape[2:])
            entry.keys = key.new_empty(shape)
            entry.values = value.new_empty(shape)

    def _write(self, entry: StaticBuffers, key: torch.Tensor, value: torch.Tensor) -> None:
        start, end = entry.len, entry.len + key.shape[1]
        if end > entry.capacity:  # check_pass refuses such passes; this guards direct calls
            raise ValueError(
                f"appending {key.shape[1]} tokens to a static buffer holding {start} of {entry.capacity}; build the "
                "engine with a larger max_frames."
            )
        for buffer, new in ((entry.keys, key), (entry.values, value)):
            target = buffer[:, start:end]
            if not _same_memory(target, new):  # a no-grad commit already wrote its chunk in place
                with writable(target):
                    target.copy_(new)
        entry.len = end

    def _pieces(self, entry: StaticBuffers, chunk_frames: int):
        if entry.keys is None or not entry.len:
            return [], []
        return [entry.keys[:, : entry.len]], [entry.values[:, : entry.len]]

    def _crop_entry(self, entry: StaticBuffers, keep_frames: int) -> None:
        entry.len = keep_frames * (entry.capacity // self.max_frames)

    def _entry_bytes(self, entry: StaticBuffers) -> int:
        return 0 if entry.keys is None else entry.keys.nbytes + entry.values.nbytes

    def __repr__(self) -> str:
        return super().__repr__().replace("(blocks=", f"(max_frames={self.max_frames}, blocks=", 1)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
