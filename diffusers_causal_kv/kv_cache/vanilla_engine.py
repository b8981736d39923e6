"""The reference engine: each block's self K/V kept as a list of per-chunk tensors.

Self entry payload (:class:`ChunkList`)
    ``keys``/``values``: one ``[batch, chunk_tokens, heads, head_dim]`` tensor per committed chunk, in order, plus
    ``len``, the number of cached tokens. Committed chunks are never written again: a commit appends a new tensor,
    :meth:`~BaseKVCacheEngine.crop` slices or drops the newest ones, :meth:`~BaseKVCacheEngine.clear` forgets them.

Reads
    No-grad and grad-enabled passes alike attend over ``torch.cat([*chunks, current])``: one fresh tensor per step.
    The copy is the price of simplicity; ``StaticKVCacheEngine``-style engines avoid it.

``start_frame`` rule
    Append-only: a cached pass on a tag starts at the number of frames the tag holds.

Cross entries, per-tag metadata and errors are those of :mod:`diffusers_causal_kv.kv_cache.base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import BaseKVCacheEngine
from .records import TagInfo


@dataclass
class ChunkList:
    frame_tokens: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    len: int = 0


class VanillaKVCacheEngine(BaseKVCacheEngine):
    """Unbounded, append-only KV cache; the simple reference every other engine is tested against."""

    def _new_entry(self, info: TagInfo) -> ChunkList:
        return ChunkList(info.frame_tokens)

    def _write(self, entry: ChunkList, key: torch.Tensor, value: torch.Tensor) -> None:
        entry.keys.append(key)
        entry.values.append(value)
        entry.len += key.shape[1]

    def _pieces(self, entry: ChunkList, chunk_frames: int):
        return entry.keys, entry.values

    def _crop_entry(self, entry: ChunkList, keep_frames: int) -> None:
        keep_tokens = keep_frames * entry.frame_tokens
        kept_keys, kept_values, total = [], [], 0
        for key, value in zip(entry.keys, entry.values):
            if total >= keep_tokens:
                break
            take = min(key.shape[1], keep_tokens - total)
            if take < key.shape[1]:  # clone so the dropped tokens' storage is released
                key, value = key[:, :take].clone(), value[:, :take].clone()
            kept_keys.append(key)
            kept_values.append(value)
            total += take
        entry.keys, entry.values, entry.len = kept_keys, kept_values, total

    def _entry_bytes(self, entry: ChunkList) -> int:
        return sum(t.nbytes for t in (*entry.keys, *entry.values))
