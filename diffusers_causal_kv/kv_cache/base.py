"""Shared storage, registration and cross-attention entries for every KV-cache engine.

An engine serves one *branch* of a transformer (``"main"`` owns ``transformer.blocks[*]``, ``"vace"`` owns
``transformer.vace_blocks[*]``). Two keys select one entry inside it: the block index, local to the branch, and
the ``cache_tag`` (``"pos"``/``"neg"`` for classifier-free guidance, or any string).

Registration
    ``_module_to_block[id(attn)] = block_idx`` for the self- and the cross-attention module of every block the
    branch owns. The model layer registers when a :class:`~diffusers_causal_kv.CausalContext` opens; processors
    look the block up through :meth:`BaseKVCacheEngine.block_index`.

Self-attention entries (``_self_kv[block_idx][cache_tag]``)
    The cached prefix of committed latent frames. The payload is engine specific (a list of chunks for the
    vanilla engine); every engine exposes it through the same verbs:

    1. :meth:`ensure_capacity` creates the entries of a tag, empty.
    2. :meth:`append_self_kv` appends one committed chunk's K/V (``[batch, tokens, heads, head_dim]``, detached).
    3. :meth:`self_attention_qkv`, the single call between processor and engine, applies the chunk's RoPE and
       returns ``[cached_prefix | current_chunk]`` to attend over (through :meth:`attention_kv`).
       :meth:`get_self_prefix` reads the prefix alone.
    4. :meth:`crop` drops the newest frames of a tag; :meth:`clear` empties every entry.

Cross-attention entries (``_cross_kv[block_idx][cache_tag]``, a :class:`CrossEntry`)
    The K/V of the whole conditioning context of a block: text tokens, plus the image tokens of Wan2.1 I2V
    (kept apart because the stock processor attends to them separately). Written once, read many times:

    1. :meth:`ensure_capacity` allocates zero K/V with ``is_init=False``.
    2. The first forward with ``store_kv=True`` fills them (at its commit).
    3. Later no-grad forwards read them and skip the K/V projections; forwards with gradients enabled
       recompute K/V from the conditioning and never read them.
    4. :meth:`clear` zeroes every entry and resets ``is_init``.

Per-tag metadata (:class:`TagInfo`)
    Batch size, dtype, device, tokens per latent frame, the number of cached frames, a fingerprint of the
    conditioning the cross entries were built from and the state of the K/V projection weights the tag was filled
    with (parameter version counters, LoRA adapter state). :meth:`check_pass` compares an incoming forward against
    it.

Lifecycle of a forward
    The model-layer hook calls :meth:`check_pass` on every engine before any work (wrong ``start_frame``, batch,
    dtype, device, frame size or conditioning raise here, the cache untouched). During the forward, processors call
    :meth:`self_attention_qkv` and :meth:`read_cross`; what a ``store_kv=True`` forward produces is *staged* on the
    :class:`~diffusers_causal_kv.context.ForwardPass`, and written when the forward returned, in two phases over
    all engines of the pass: :meth:`prepare_commit` allocates (undone by :meth:`abort_commit` if any engine fails
    to), then :meth:`commit` writes into the allocated storage. A forward that raises commits nothing; writes go
    through :func:`writable`, so storage allocated under ``torch.inference_mode()`` stays writable outside it.

Errors
    ``ValueError`` for inputs that do not continue a tag (``start_frame``, batch size, dtype, device, frame size,
    conditioning); ``RuntimeError`` for a tag whose K/V projection weights changed since it was filled (stale);
    ``KeyError`` for a module the engine did not register. Each message names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..positions import apply_rotary_emb

if TYPE_CHECKING:
    from ..context import ForwardPass, StagedKV


@dataclass
class CrossEntry:
    """Cross-attention K/V of one block and tag: ``[batch, tokens, heads, head_dim]`` each."""

    key: torch.Tensor
    value: torch.Tensor
    key_img: torch.Tensor | None = None
    value_img: torch.Tensor | None = None
    is_init: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value, self.key_img, self.value_img) if t is not None]


@dataclass
class TagInfo:
    """What a tag was built with; later forwards on the tag must match it."""

    batch_size: int
    dtype: torch.dtype
    device: torch.device
    frame_tokens: int
    num_frames: int = 0
    conditioning: tuple | None = field(default=None, repr=False)
    weights: tuple | None = field(default=None, repr=False)


class BaseKVCacheEngine:
    """Storage shared by all engines: registration, per-tag metadata and cross-attention entries.

    Subclasses implement the self-attention payload through the ``_self_*`` methods; an engine that re-indexes
    positions overrides :meth:`self_attention_qkv` to cache keys before RoPE.
    """

    def __init__(self) -> None:
        self._module_to_block: dict[int, int] = {}
        self._self_kv: dict[int, dict[str, Any]] = {}
        self._cross_kv: dict[int, dict[str, CrossEntry]] = {}
        self._tags: dict[str, TagInfo] = {}

    # ------------------------------------------------------------------ registration
    def register_module(self, attn: torch.nn.Module, block_idx: int) -> None:
        """Record that ``attn`` is (self- or cross-) attention of this branch's block ``block_idx``."""
        self._module_to_block[id(attn)] = block_idx

    def owns(self, attn: torch.nn.Module) -> bool:
        return id(attn) in self._module_to_block

    def block_index(self, attn: torch.nn.Module) -> int:
        try:
            return self._module_to_block[id(attn)]
        except KeyError:
            raise KeyError(
                f"{type(attn).__name__} at {id(attn):#x} is not registered with this {type(self).__name__}; "
                "open a CausalContext on the transformer that owns it (registration happens there)."
            ) from None

    @property
    def num_blocks(self) -> int:
        return len(set(self._module_to_block.values()))

    # ------------------------------------------------------------------ state queries
    def tags(self) -> list[str]:
        return list(self._tags)

    def num_frames(self, cache_tag: str) -> int:
        """Number of latent frames the tag holds."""
        info = self._tags.get(cache_tag)
        return 0 if info is None else info.num_frames

    def next_frame(self, cache_tag: str) -> int:
        """The ``start_frame`` the next cached pass on ``cache_tag`` must use (append-only: the cached frames)."""
        return self.num_frames(cache_tag)

    #: Whether :meth:`rope_start_frame` numbers frames inside a window rather than absolutely (then
    #: ``rope_max_seq_len`` does not bound the length of a rollout).
    reindexes_positions = False

    def rope_start_frame(self, cache_tag: str, start_frame: int, num_frames: int) -> int:
        """Temporal RoPE position of the first frame of a chunk of ``num_frames`` frames at ``start_frame``.

        Engines caching keys after RoPE place a chunk at its absolute frame index, ``start_frame``, which
        ``rope_max_seq_len`` bounds; an engine that re-indexes positions inside a window returns the chunk's
        position there. The model layer asks before any work and checks the result against the RoPE table.
        """
        return start_frame

    def is_cross_init(self, cache_tag: str) -> bool:
        return any(tags[cache_tag].is_init for tags in self._cross_kv.values() if cache_tag in tags)

    def memory_bytes(self) -> int:
        """Exact bytes held by the tensors of every self and cross entry."""
        total = sum(self._self_entry_bytes(e) for tags in self._self_kv.values() for e in tags.values())
        total += sum(t.nbytes for tags in self._cross_kv.values() for e in tags.values() for t in e.tensors())
        return total

    # ------------------------------------------------------------------ lifecycle verbs
    def ensure_capacity(self, cache_tag: str, info: TagInfo, cross_like: dict[int, CrossEntry]) -> None:
        """Create the tag's entries if missing: empty self entries, zeroed cross entries with ``is_init=False``.

        ``cross_like`` gives, per block, tensors whose shapes the cross entries take.
        """
        if cache_tag not in self._tags:
            self._tags[cache_tag] = TagInfo(info.batch_size, info.dtype, info.device, info.frame_tokens,
                                            weights=info.weights)
        for block_idx in sorted(set(self._module_to_block.values())):
            tags = self._self_kv.setdefault(block_idx, {})
            if cache_tag not in tags:
                tags[cache_tag] = self._self_new_entry(info)
        for block_idx, like in cross_like.items():
            tags = self._cross_kv.setdefault(block_idx, {})
            held = tags.get(cache_tag)
            # A zeroed entry left by clear() is reused unless the new conditioning has another shape.
            if held is None or (not held.is_init and _shapes(held) != _shapes(like)):
                tags[cache_tag] = CrossEntry(
                    *(None if t is None else torch.zeros_like(t)
                      for t in (like.key, like.value, like.key_img, like.value_img))
                )

    def append_self_kv(self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append one committed chunk's K/V to a block's self entry (the tag's frame count is kept by commit)."""
        self._self_append(self._self_kv[block_idx][cache_tag], key.detach(), value.detach())

    def get_self_prefix(self, block_idx: int, cache_tag: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cached prefix K/V of a block as fresh tensors, or ``None`` when the tag holds no frames (a bounded engine
        may hold none of the frames committed to it)."""
        entry = self._self_kv.get(block_idx, {}).get(cache_tag)
        if entry is None or self.num_frames(cache_tag) == 0:
            return None
        return self._self_prefix(entry)

    def read_cross(self, block_idx: int, cache_tag: str) -> CrossEntry | None:
        """The block's filled cross entry for the tag, or ``None`` if it is not initialised."""
        entry = self._cross_kv.get(block_idx, {}).get(cache_tag)
        return entry if entry is not None and entry.is_init else None

    def crop(self, num_frames: int, cache_tag: str | None = None) -> None:
        """Keep the first ``num_frames`` cached frames (a negative value drops that many newest ones).

        Applies to ``cache_tag``, or to every tag when ``None``. Cross entries are kept.
        """
        targets = [cache_tag] if cache_tag is not None else self.tags()
        keep = {}
        for tag in targets:  # validate every tag before cropping any
            cached = self.num_frames(tag)
            keep[tag] = num_frames if num_frames >= 0 else cached + num_frames
            if not 0 <= keep[tag] <= cached:
                raise ValueError(
                    f"crop({num_frames}) on cache tag {tag!r}, which holds {cached} frames: pass a frame count "
                    f"between {-cached} and {cached}."
                )
        for tag in targets:
            info = self._tags.get(tag)
            if info is None:
                continue
            for tags in self._self_kv.values():
                self._self_crop(tags[tag], keep[tag] * info.frame_tokens)
            info.num_frames = keep[tag]

    def clear(self) -> None:
        """Empty every self entry, zero every cross entry and forget every tag's metadata."""
        for tags in self._cross_kv.values():
            for entry in tags.values():
                for t in entry.tensors():
                    with writable(t):
                        t.zero_()
                entry.is_init = False
        self._self_kv.clear()
        self._tags.clear()

    # ------------------------------------------------------------------ the pass protocol
    def check_schedule(self, first_frame: int, sizes: list[int]) -> None:
        """Raise if chunks of ``sizes`` frames from ``first_frame`` on cannot run on this engine; the rollout helpers
        ask before they clear or commit anything. Append-only engines without a bound take any schedule."""

    def check_pass(self, p: ForwardPass) -> None:
        """Raise if the forward ``p`` does not continue its tag's cache. Called before any work."""
        tag, info = p.cache_tag, self._tags.get(p.cache_tag)
        expected = self.next_frame(tag)
        if p.start_frame != expected:
            raise ValueError(
                f"cache tag {tag!r} holds {self.num_frames(tag)} frames but start_frame={p.start_frame}; "
                f"call clear_caches() or pass start_frame={expected}."
            )
        if info is None:
            return
        for what, cached, given in (
            ("batch size", info.batch_size, p.batch_size),
            ("dtype", info.dtype, p.dtype),
            ("device", info.device, p.device),
            ("tokens per latent frame", info.frame_tokens, p.frame_tokens),
        ):
            if cached != given:
                raise ValueError(
                    f"cache tag {tag!r} was built with {what} {cached} but this forward has {given}; "
                    f"call clear_caches() before changing it, or use another cache_tag."
                )
        if info.conditioning is not None and info.conditioning != p.conditioning_fingerprint():
            raise ValueError(
                f"cache tag {tag!r} holds cross-attention K/V built from other conditioning (a different prompt "
                "or image embedding); call clear_caches() before changing the conditioning of a tag, "
                "or use another cache_tag."
            )
        if info.weights is not None and info.weights != p.weights_fingerprint():
            raise RuntimeError(
                f"the K/V projection weights changed since cache tag {tag!r} was filled (an optimizer step, "
                "load_lora_adapter/set_adapters/fuse_lora/unfuse_lora, or an in-place weight edit), so its cached "
                "K/V are stale; call clear_caches() after changing weights and roll out again."
            )

    def self_attention_qkv(self, block_idx: int, p: ForwardPass, query, key, value, rotary_emb):
        """The one call between processor and engine: what self-attention attends with.

        Takes the current chunk's query/key/value (``[batch, tokens, heads, head_dim]``, before RoPE) and the
        chunk's rotary embedding, and returns ``(query, key, value)`` where key/value are
        ``[cached prefix | current chunk]``. Positions are the engine's business: this engine caches keys after
        RoPE; an engine that re-indexes positions caches them before and rotates at read time.
        """
        if rotary_emb is not None:
            query, key = apply_rotary_emb(query, *rotary_emb), apply_rotary_emb(key, *rotary_emb)
        return (query, *self.attention_kv(block_idx, p, key, value))

    def attention_kv(self, block_idx: int, p: ForwardPass, key: torch.Tensor, value: torch.Tensor):
        """``[prefix | current chunk]`` K/V for a chunk whose keys already carry their positions.

        A ``store_kv=True`` forward stages the chunk's K/V for :meth:`commit`. Forwards with gradients enabled
        attend over fresh tensors (never views of storage a later commit could overwrite) and remember the prefix
        they read, so a gradient-checkpointing recomputation sees the same prefix even if more chunks were
        committed since.
        """
        if p.store_kv and not p.recomputing:
            p.staged_for(self).self_kv[block_idx] = (key.detach(), value.detach())
        if torch.is_grad_enabled():
            prefix = p.remembered_prefix(self, block_idx, lambda: self.get_self_prefix(block_idx, p.cache_tag))
            if prefix is None:
                return key, value
            return torch.cat([prefix[0], key], dim=1), torch.cat([prefix[1], value], dim=1)
        entry = self._self_kv.get(block_idx, {}).get(p.cache_tag)
        if entry is None or self.num_frames(p.cache_tag) == 0:
            return key, value
        return self._self_attend(entry, key, value)

    def prepare_commit(self, p: ForwardPass, staged: StagedKV) -> None:
        """First half of a commit: allocate what :meth:`commit` writes into (the only step that may run out of
        memory): the tag's entries and, on its first commit, the self-attention storage of engines that preallocate
        it. Undone by :meth:`abort_commit` if another engine of the same forward fails to prepare."""
        info = TagInfo(p.batch_size, p.dtype, p.device, p.frame_tokens, weights=p.weights_fingerprint())
        staged.created_tag = p.cache_tag not in self._tags
        try:
            self.ensure_capacity(p.cache_tag, info, staged.cross_kv)
            for block_idx, (key, value) in staged.self_kv.items():
                self._self_allocate(self._self_kv[block_idx][p.cache_tag], key, value)
        except BaseException:
            self.abort_commit(p, staged)
            raise

    def abort_commit(self, p: ForwardPass, staged: StagedKV) -> None:
        """Undo :meth:`prepare_commit`: forget a tag it created (existing tags gained no state from it)."""
        if staged.created_tag:
            self._tags.pop(p.cache_tag, None)
            for tags in (*self._self_kv.values(), *self._cross_kv.values()):
                tags.pop(p.cache_tag, None)

    def commit(self, p: ForwardPass, staged: StagedKV) -> None:
        """Second half: write what a ``store_kv=True`` forward staged into storage :meth:`prepare_commit`
        allocated: one chunk of frames for every block, and the cross entries if the tag had none yet."""
        tag = p.cache_tag
        for block_idx, (key, value) in staged.self_kv.items():
            self.append_self_kv(block_idx, tag, key, value)
        self._tags[tag].num_frames += p.num_frames
        if staged.cross_kv and not self.is_cross_init(tag):
            for block_idx, filled in staged.cross_kv.items():
                entry = self._cross_kv[block_idx][tag]
                for dst, src in zip(entry.tensors(), filled.tensors()):
                    with writable(dst):
                        dst.copy_(src)
                entry.is_init = True
            self._tags[tag].conditioning = p.conditioning_fingerprint()

    # ------------------------------------------------------------------ engine-specific self payload
    def _self_new_entry(self, info: TagInfo) -> Any:
        raise NotImplementedError

    def _self_allocate(self, entry: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        """Allocate the entry's storage for chunks shaped like ``key``/``value`` if it has none (default: nothing to
        preallocate)."""

    def _self_append(self, entry: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        raise NotImplementedError

    def _self_prefix(self, entry: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _self_attend(self, entry: Any, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _self_crop(self, entry: Any, keep_tokens: int) -> None:
        raise NotImplementedError

    def _self_entry_bytes(self, entry: Any) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        tags = ", ".join(
            f"{tag!r}: {info.num_frames} frames x {info.frame_tokens} tokens, batch {info.batch_size}, "
            f"cross {'filled' if self.is_cross_init(tag) else 'empty'}"
            for tag, info in self._tags.items()
        )
        return (
            f"{type(self).__name__}(blocks={self.num_blocks}, tags={{{tags}}}, "
            f"memory={self.memory_bytes() / 2**20:.2f} MiB)"
        )


def writable(tensor: torch.Tensor):
    """In-place writes into cache storage, which may have been allocated under ``torch.inference_mode()`` (a
    rollout run there) and be written outside it later, or the other way round."""
    return torch.inference_mode(tensor.is_inference())


def _shapes(entry: CrossEntry) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in entry.tensors()]
