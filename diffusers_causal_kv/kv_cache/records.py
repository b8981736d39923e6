"""The records engines exchange with their callers: what a pass is (:class:`PassInfo`), what a tag was built with
(:class:`TagInfo`), a block's cross-attention K/V (:class:`CrossEntry`), what a committing forward staged
(:class:`StagedChunk`) and what :meth:`~diffusers_causal_kv.kv_cache.BaseKVCacheEngine.update` returns
(:class:`AttentionKV`). Data only; the contract is in :mod:`.base`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class PassInfo:
    """What an engine knows of one transformer forward on one tag (built by the model layer after validation)."""

    cache_tag: str
    start_frame: int
    chunk_frames: int
    """Post-patch latent frames of this forward's chunk."""
    frame_tokens: int
    """Tokens per latent frame (post-patch height x width)."""
    batch_size: int
    dtype: torch.dtype
    device: torch.device
    grad_enabled: bool
    store_kv: bool
    conditioning: tuple = field(default=(), repr=False)
    """A fingerprint of the conditioning inputs; a filled tag accepts only the one it was filled with."""
    weights: tuple = field(default=(), repr=False)
    """The state of everything that computes cached K/V; a filled tag refuses another one as stale."""


@dataclass
class CrossEntry:
    """Cross-attention K/V of one block and tag: ``[batch, tokens, heads, head_dim]`` each."""

    key: torch.Tensor
    value: torch.Tensor
    key_img: torch.Tensor | None = None
    value_img: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value, self.key_img, self.value_img) if t is not None]


@dataclass
class StagedChunk:
    """What one ``store_kv=True`` forward produced for one engine: the chunk's K/V per block (as :meth:`~
    BaseKVCacheEngine.update` returned them for the commit) and the projected cross K/V per block."""

    self_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cross_kv: dict[int, CrossEntry] = field(default_factory=dict)


class AttentionKV(NamedTuple):
    """Result of :meth:`BaseKVCacheEngine.update`: what to attend over, and what a commit of the chunk stores."""

    key: torch.Tensor
    value: torch.Tensor
    commit_key: torch.Tensor
    commit_value: torch.Tensor


@dataclass
class TagInfo:
    """What a tag was built with; later passes on the tag must match it."""

    batch_size: int
    dtype: torch.dtype
    device: torch.device
    frame_tokens: int
    committed_frames: int = 0
    """Frames committed to the tag so far (for bounded engines, evicted ones included)."""
    conditioning: tuple | None = field(default=None, repr=False)
    weights: tuple | None = field(default=None, repr=False)
