"""The engine contract: what every KV-cache engine does, and the one place its policies are decided.

An engine serves one *branch* of a transformer (``"main"`` owns ``transformer.blocks[*]``, ``"vace"`` owns
``transformer.vace_blocks[*]``). Two keys select one entry inside it: the block index, local to the branch, and the
``cache_tag`` (``"pos"``/``"neg"`` for classifier-free guidance, or any string). Engines know tensors only: a pass
is described to them by a frozen :class:`PassInfo`, positions arrive as a :class:`~diffusers_causal_kv.rotary.
ChunkRotary`, and this package imports nothing above it but that leaf.

Registration
    :meth:`register_module` records ``attn -> block_idx`` for the self- and the cross-attention module of every
    block the branch owns (the model layer does it when a context first opens); :meth:`owns` and
    :meth:`block_index` answer the processors, :func:`owning_engine` routes among the engines of a map.

Self-attention entries (``_self_kv[block_idx][cache_tag]``)
    The committed prefix. The payload is a concrete engine's storage; it implements six small hooks
    (``_new_entry``, ``_allocate``, ``_write``, ``_pieces``, ``_crop_entry``, ``_entry_bytes``) and nothing else of the
    protocol. The base class decides, once for every engine:

    * **the one call**, :meth:`update`: given the chunk's key/value (``[batch, tokens, heads, head_dim]``, key
      before RoPE) and its :class:`ChunkRotary`, return the K/V to attend over, ``[prefix | chunk]``, and the chunk's
      K/V as a commit would store them (the caller stages those for a ``store_kv=True`` pass);
    * **positions**: engines that keep absolute positions store keys after RoPE; an engine that sets
      :attr:`reindexes_positions` stores them before and the prefix is rotated at read time to window positions
      ``0, 1, ...`` (the chunk then sits right after it, at :meth:`rope_start_frame`);
    * **gradients**: a pass with gradients enabled attends over fresh tensors (never a view of storage a later
      commit, crop or eviction could overwrite) and remembers the prefix it read in the caller's ``memo``, so a
      gradient-checkpointing recomputation sees the same prefix even after later commits; it writes nothing. Only a
      no-grad pass may attend over views or write scratch in place (:meth:`_attend_no_grad`).

Cross-attention entries (``_cross_kv[block_idx][cache_tag]``, a :class:`CrossEntry`)
    The K/V of the whole conditioning of a block: text tokens, plus the image tokens of Wan2.1 I2V (kept apart, as
    the stock processor attends to them separately). Written by the tag's first commit, read by later no-grad
    passes (:meth:`read_cross`); passes with gradients enabled recompute them and never read them.

Storage format (``kv_dtype``)
    ``None`` (the default) stores K/V as computed; ``torch.float8_e4m3fn`` (or ``torch.float8_e5m2``) stores self and
    cross entries as fp8 codes with scales (:mod:`.quantized`). The base class encodes what a commit hands the storage
    hooks and decodes what :meth:`_pieces` and the cross entries hold into the tag's dtype, so the hooks store
    encoded tensors like any other.

Per-tag metadata (:class:`TagInfo`)
    Batch size, dtype, device, tokens per latent frame, frames committed, and the conditioning fingerprint and K/V
    projection state the tag was filled with. :meth:`check_pass` compares an incoming pass against it before any
    work; :meth:`check_schedule` answers for a whole rollout before it starts.

Commits (two phases over every engine of a pass, run by the caller)
    :meth:`prepare_commit` allocates (the only step that may run out of memory) and says whether it created the
    tag; :meth:`abort_commit` undoes that if another engine failed to prepare; :meth:`commit` writes the staged chunk
    and, on the tag's first commit, its cross entries. Writes go through :func:`writable`, so storage allocated
    under ``torch.inference_mode()`` stays writable outside it and the other way round.

Going back and clearing
    :meth:`crop` drops the newest frames of one tag or every tag (cross entries kept). :meth:`clear` drops every
    entry of one tag or of every tag: afterwards the engine holds nothing of them, and the tag's next pass starts
    at frame 0 with any conditioning, dtype or device.

Errors
    ``ValueError`` for passes that do not continue a tag (``start_frame``, batch size, dtype, device, frame size,
    conditioning); ``RuntimeError`` for a tag whose K/V projection state changed since it was filled (stale);
    ``KeyError`` for a module the engine did not register. Each message names the fix.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch

from ..rotary import ChunkRotary, apply_rotary_emb
from .quantized import kv_storage
from .records import AttentionKV, CrossEntry, PassInfo, StagedChunk, TagInfo

_WRITES = itertools.count(1)


class BaseKVCacheEngine:
    """The engine contract (see the module docstring); subclasses implement storage only."""

    #: Whether keys are cached before RoPE and the prefix is numbered ``0, 1, ...`` at read time (then
    #: ``rope_max_seq_len`` does not bound the length of a rollout).
    reindexes_positions = False
    #: Whether the engine can continue a tag at a later frame (``skip_to``) and take over a tag rebuilt in an
    #: :meth:`empty_like` engine (``adopt_tag``): what re-caching a window and prefilling after a gap need.
    supports_refill = False

    def __init__(self, kv_dtype: torch.dtype | None = None) -> None:
        self._storage = kv_storage(kv_dtype)
        self.kv_dtype = kv_dtype
        self._module_to_block: dict[int, int] = {}
        self._self_kv: dict[int, dict[str, Any]] = {}
        self._cross_kv: dict[int, dict[str, CrossEntry]] = {}
        self._tags: dict[str, TagInfo] = {}
        self._write_stamps: dict[str, int] = {}

    # ------------------------------------------------------------------ registration
    def register_module(self, attn: torch.nn.Module, block_idx: int) -> None:
        """Record that ``attn`` is (self- or cross-) attention of this branch's block ``block_idx``."""
        self._module_to_block[id(attn)] = block_idx

    def owns(self, attn: torch.nn.Module) -> bool:
        """Whether ``attn`` was registered with this engine."""
        return id(attn) in self._module_to_block

    def block_index(self, attn: torch.nn.Module) -> int:
        """The block ``attn`` was registered at (local to this engine's branch)."""
        try:
            return self._module_to_block[id(attn)]
        except KeyError:
            raise KeyError(
                f"{type(attn).__name__} at {id(attn):#x} is not registered with this {type(self).__name__}; "
                "open a CausalContext on the transformer that owns it (registration happens there)."
            ) from None

    @property
    def num_blocks(self) -> int:
        """The number of blocks registered with this engine (its branch's blocks)."""
        return len(set(self._module_to_block.values()))

    def empty_like(self) -> BaseKVCacheEngine:
        """A new, empty engine of this class with this one's settings (an engine whose constructor takes arguments
        overrides it)."""
        return type(self)(kv_dtype=self.kv_dtype)

    # ------------------------------------------------------------------ state queries
    def write_stamp(self, cache_tag: str) -> int:
        """A number that changes whenever ``cache_tag`` is written, cropped, cleared, skipped or re-conditioned (0
        before its first write). A stream compares it with the stamp after its own last write to find writes by
        another caller, which a frame count cannot tell (another rollout of the same length)."""
        return self._write_stamps.get(cache_tag, 0)

    def _stamp(self, cache_tag: str) -> None:
        # One counter for every engine: a stamp is never repeated, even by another engine at the same address.
        self._write_stamps[cache_tag] = next(_WRITES)

    def held_frames(self, cache_tag: str) -> list[range]:
        """The absolute frame indices the tag holds, in order (an append-only engine holds every committed frame)."""
        frames = self.num_frames(cache_tag)
        return [range(frames)] if frames else []

    def tags(self) -> list[str]:
        """The tags holding entries."""
        return list(self._tags)

    def num_frames(self, cache_tag: str) -> int:
        """Frames committed to the tag so far (append-only engines hold all of them)."""
        info = self._tags.get(cache_tag)
        return 0 if info is None else info.committed_frames

    def next_frame(self, cache_tag: str) -> int:
        """The ``start_frame`` the next cached pass on ``cache_tag`` must use."""
        return self.num_frames(cache_tag)

    def rope_start_frame(self, cache_tag: str, start_frame: int, chunk_frames: int) -> int:
        """Temporal RoPE position of the first frame of a chunk of ``chunk_frames`` frames at ``start_frame``: the
        absolute frame index, or, for an engine that re-indexes positions, the number of prefix frames it reads."""
        if not self.reindexes_positions:
            return start_frame
        entry = self._any_entry(cache_tag)
        return 0 if entry is None else sum(k.shape[1] for k in self._pieces(entry, chunk_frames)[0]) // (
            self._tags[cache_tag].frame_tokens)

    def is_cross_init(self, cache_tag: str) -> bool:
        """Whether the tag's cross entries are filled."""
        return any(cache_tag in tags for tags in self._cross_kv.values())

    def memory_bytes(self) -> int:
        """Exact bytes held by the tensors of every self and cross entry."""
        total = sum(self._entry_bytes(e) for tags in self._self_kv.values() for e in tags.values())
        return total + sum(t.nbytes for tags in self._cross_kv.values() for e in tags.values() for t in e.tensors())

    # ------------------------------------------------------------------ checks (before any work)
    def check_schedule(self, first_frame: int, sizes: list[int]) -> None:
        """Raise if chunks of ``sizes`` frames from ``first_frame`` on cannot run on this engine (asked before a
        rollout clears or commits anything). Unbounded append-only engines take any schedule."""

    def check_pass(self, info: PassInfo) -> None:
        """Raise if the pass does not continue its tag's cache. Called before any work."""
        tag, tag_info = info.cache_tag, self._tags.get(info.cache_tag)
        expected = self.next_frame(tag)
        if info.start_frame != expected:
            raise ValueError(
                f"cache tag {tag!r} holds {self.num_frames(tag)} frames but start_frame={info.start_frame}; "
                f"call clear_caches() or pass start_frame={expected}."
            )
        if tag_info is None:
            return
        for what, cached, given in (
            ("batch size", tag_info.batch_size, info.batch_size), ("dtype", tag_info.dtype, info.dtype),
            ("device", tag_info.device, info.device), ("tokens per latent frame", tag_info.frame_tokens,
                                                       info.frame_tokens),
        ):
            if cached != given:
                raise ValueError(
                    f"cache tag {tag!r} was built with {what} {cached} but this forward has {given}; "
                    f"call clear_caches() before changing it, or use another cache_tag."
                )
        if tag_info.conditioning is not None and tag_info.conditioning != info.conditioning:
            raise ValueError(
                f"cache tag {tag!r} holds cross-attention K/V built from other conditioning (a different prompt "
                "or image embedding); call clear_caches() before changing the conditioning of a tag, "
                "or use another cache_tag."
            )
        if tag_info.weights is not None and tag_info.weights != info.weights:
            raise RuntimeError(
                f"the K/V projection weights changed since cache tag {tag!r} was filled (an optimizer step, "
                "load_lora_adapter/set_adapters/fuse_lora/unfuse_lora, or an in-place weight edit), so its cached "
                "K/V are stale; call clear_caches() after changing weights and roll out again."
            )

    # ------------------------------------------------------------------ reads
    def update(self, block_idx: int, info: PassInfo, key: torch.Tensor, value: torch.Tensor,
               rotary: ChunkRotary | None, memo: dict | None = None) -> AttentionKV:
        """The one call between processor and engine (see the module docstring). ``key`` is before RoPE; ``memo``
        is a dict the caller keeps per pass and engine, for grad-enabled passes."""
        chunk_key = key if rotary is None else rotary.apply(key)
        stored_key = key if self.reindexes_positions else chunk_key
        if not info.grad_enabled:
            return self._attend_no_grad(block_idx, info, chunk_key, value, stored_key, rotary)
        memo = {} if memo is None else memo
        if block_idx not in memo:
            memo[block_idx] = self._read(block_idx, info.cache_tag, info.chunk_frames, rotary)
        keys, values = _join(memo[block_idx], chunk_key, value)
        return AttentionKV(keys, values, stored_key.detach(), value.detach())

    def get_self_prefix(self, block_idx: int, cache_tag: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every frame a block holds for the tag, in the tag's dtype (fresh tensors), or ``None`` when it holds
        none."""
        return self._read(block_idx, cache_tag, 0, None)

    def read_cross(self, block_idx: int, cache_tag: str) -> CrossEntry | None:
        """The block's filled cross entry for the tag (decoded), or ``None``."""
        entry = self._cross_kv.get(block_idx, {}).get(cache_tag)
        if entry is None:
            return None
        dtype = self._tags[cache_tag].dtype
        return CrossEntry(*(None if t is None else self._storage.decode(t, None, dtype) for t in (
            entry.key, entry.value, entry.key_img, entry.value_img)))

    def _read(self, block_idx, cache_tag, chunk_frames, rotary) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prefix a chunk of ``chunk_frames`` frames attends to (0: every held frame), as fresh tensors; keys
        rotated to window positions when this engine re-indexes them and ``rotary`` is given."""
        entry = self._self_kv.get(block_idx, {}).get(cache_tag)
        keys, values = ([], []) if entry is None else self._decoded_pieces(entry, cache_tag, chunk_frames)
        if not keys:
            return None
        key, value = torch.cat(keys, dim=1), torch.cat(values, dim=1)
        if self.reindexes_positions and rotary is not None:
            frame_tokens = self._tags[cache_tag].frame_tokens
            key = apply_rotary_emb(key, *rotary.for_frames(key.shape[1] // frame_tokens, frame_tokens))
        return key, value

    def _attend_no_grad(self, block_idx, info, chunk_key, value, stored_key, rotary) -> AttentionKV:
        """A no-grad pass: ``[prefix | chunk]`` in one copy (an engine may attend over views instead)."""
        if self.reindexes_positions:
            keys, values = _join(self._read(block_idx, info.cache_tag, info.chunk_frames, rotary), chunk_key, value)
            return AttentionKV(keys, values, stored_key, value)
        entry = self._self_kv.get(block_idx, {}).get(info.cache_tag)
        keys, values = ([], []) if entry is None else self._decoded_pieces(entry, info.cache_tag, info.chunk_frames)
        if not keys:
            return AttentionKV(chunk_key, value, stored_key, value)
        return AttentionKV(torch.cat([*keys, chunk_key], dim=1), torch.cat([*values, value], dim=1), stored_key, value)

    def _decoded_pieces(self, entry, cache_tag: str, chunk_frames: int):
        """:meth:`_pieces` decoded into the tag's dtype (the views themselves when K/V are stored as computed)."""
        keys, values = self._pieces(entry, chunk_frames)
        info = self._tags[cache_tag]
        return tuple([self._storage.decode(t, info.frame_tokens, info.dtype) for t in pieces]
                     for pieces in (keys, values))

    # ------------------------------------------------------------------ commits
    def prepare_commit(self, info: PassInfo, staged: StagedChunk) -> bool:
        """Allocate what :meth:`commit` writes into; returns whether it created the tag (for :meth:`abort_commit`)."""
        created = info.cache_tag not in self._tags
        if created:
            self._tags[info.cache_tag] = TagInfo(info.batch_size, info.dtype, info.device, info.frame_tokens,
                                                 weights=info.weights)
        try:
            for block_idx in sorted(set(self._module_to_block.values())):
                entries = self._self_kv.setdefault(block_idx, {})
                if info.cache_tag not in entries:
                    entries[info.cache_tag] = self._new_entry(self._tags[info.cache_tag])
            for block_idx, (key, value) in staged.self_kv.items():
                self._allocate(self._self_kv[block_idx][info.cache_tag],
                               *(self._storage.encoded_like(t, info.frame_tokens) for t in (key, value)))
        except BaseException:
            self.abort_commit(info, created)
            raise
        return created

    def abort_commit(self, info: PassInfo, created: bool) -> None:
        """Undo :meth:`prepare_commit`: forget a tag it created (existing tags gained no state from it)."""
        if created:
            self._drop_tag(info.cache_tag)

    def commit(self, info: PassInfo, staged: StagedChunk) -> None:
        """Write the staged chunk into every block, and the cross entries if the tag had none yet."""
        tag = info.cache_tag
        for block_idx, (key, value) in staged.self_kv.items():
            self._write_encoded(block_idx, tag, key, value)
        self._tags[tag].committed_frames += info.chunk_frames
        self._stamp(tag)
        if staged.cross_kv and not self.is_cross_init(tag):
            # Copied once per tag: the staged tensors may be outputs of compiled blocks whose memory CUDA graphs
            # reuse on their next replay.
            for block_idx, entry in staged.cross_kv.items():
                self._cross_kv.setdefault(block_idx, {})[tag] = CrossEntry(*(
                    None if t is None else self._storage.encode(t.detach()).clone()
                    for t in (entry.key, entry.value, entry.key_img, entry.value_img)))
            self._tags[tag].conditioning = info.conditioning

    def _write_encoded(self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """:meth:`_write` a committed chunk in the storage format."""
        frame_tokens = self._tags[cache_tag].frame_tokens
        self._write(self._self_kv[block_idx][cache_tag], *(self._storage.encode(t.detach(), frame_tokens)
                                                           for t in (key, value)))

    def reset_conditioning(self, cache_tag: str) -> None:
        """Let a filled tag continue under new conditioning: drop its cross entries and conditioning fingerprint and
        keep its self K/V, so the next passes compute the cross K/V of whatever conditioning they bring and the next
        commit stores them (a prompt switch that re-encodes the prompt only, without re-caching the frames)."""
        if cache_tag not in self._tags:
            raise ValueError(
                f"reset_conditioning({cache_tag!r}): the engine holds no such tag (tags: {self.tags()}); a tag "
                "that was never filled takes any conditioning already."
            )
        for entries in self._cross_kv.values():
            entries.pop(cache_tag, None)
        self._tags[cache_tag].conditioning = None
        self._stamp(cache_tag)

    # ------------------------------------------------------------------ going back
    def crop(self, num_frames: int, cache_tag: str | None = None) -> None:
        """Keep the first ``num_frames`` committed frames of ``cache_tag`` (every tag when ``None``); a negative
        value drops that many newest ones. Cross entries are kept."""
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
            self._check_crop(tag, keep[tag], num_frames)
        for tag in targets:
            if tag in self._tags:
                for entries in self._self_kv.values():
                    self._crop_entry(entries[tag], keep[tag])
                self._tags[tag].committed_frames = keep[tag]
                self._stamp(tag)

    def check_rope_table(self, positions: int) -> None:
        """Raise if this engine numbers positions past a RoPE table of ``positions`` rows (only an engine that
        re-indexes positions decides its own; the model layer checks the others' absolute positions)."""

    def _check_crop(self, cache_tag: str, keep: int, num_frames: int) -> None:
        """Raise if the tag cannot end at frame ``keep`` (an engine that evicts frames cannot restore them)."""

    def clear(self, cache_tag: str | None = None) -> None:
        """Drop every entry of ``cache_tag``, or of every tag when ``None``: afterwards the engine holds nothing of
        them, and their next pass starts at frame 0 with any conditioning, dtype or device."""
        for tag in [cache_tag] if cache_tag is not None else self.tags():
            self._drop_tag(tag)

    def _drop_tag(self, cache_tag: str) -> None:
        self._tags.pop(cache_tag, None)
        self._stamp(cache_tag)
        # Emptied blocks go too, so that a cleared engine is laid out like a new one (compiled graphs guard on it:
        # a stream restarted after clear() then reuses the graphs of the first one).
        for entries_of in (self._self_kv, self._cross_kv):
            for block_idx in list(entries_of):
                entries_of[block_idx].pop(cache_tag, None)
                if not entries_of[block_idx]:
                    del entries_of[block_idx]

    def _any_entry(self, cache_tag: str):
        return next((tags[cache_tag] for tags in self._self_kv.values() if cache_tag in tags), None)

    # ------------------------------------------------------------------ storage: what a concrete engine implements
    def _new_entry(self, info: TagInfo) -> Any:
        """An empty self-attention payload for a tag described by ``info``."""
        raise NotImplementedError

    def _allocate(self, entry: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        """Allocate storage for chunks shaped like ``key``/``value`` if the entry has none (default: nothing)."""

    def _write(self, entry: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append one committed chunk (keys as stored)."""
        raise NotImplementedError

    def _pieces(self, entry: Any, chunk_frames: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the keys and values a chunk of ``chunk_frames`` frames attends to, in order (0: all held)."""
        raise NotImplementedError

    def _crop_entry(self, entry: Any, keep_frames: int) -> None:
        """Keep the first ``keep_frames`` committed frames."""
        raise NotImplementedError

    def _entry_bytes(self, entry: Any) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ deprecated verbs of 0.1
    def append_self_kv(self, block_idx: int, cache_tag: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """Deprecated: commits go through :meth:`prepare_commit` and :meth:`commit`."""
        warnings.warn("append_self_kv() is deprecated; commit through prepare_commit()/commit().",
                      DeprecationWarning, stacklevel=2)
        self._write_encoded(block_idx, cache_tag, key, value)

    def __repr__(self) -> str:
        tags = ", ".join(
            f"{tag!r}: {info.committed_frames} frames x {info.frame_tokens} tokens, batch {info.batch_size}, "
            f"cross {'filled' if self.is_cross_init(tag) else 'empty'}"
            for tag, info in self._tags.items()
        )
        return (
            f"{type(self).__name__}(blocks={self.num_blocks}, tags={{{tags}}}, "
            f"memory={self.memory_bytes() / 2**20:.2f} MiB"
            + ("" if self.kv_dtype is None else f", kv_dtype={self.kv_dtype}") + ")"
        )


def owning_engine(engines: dict[str, BaseKVCacheEngine], attn: torch.nn.Module) -> BaseKVCacheEngine:
    """The engine of ``engines`` that registered ``attn``; raises if none did."""
    for engine in engines.values():
        if engine.owns(attn):
            return engine
    raise RuntimeError(
        f"No KV-cache engine of this CausalContext registered the attention module {type(attn).__name__} at "
        f"{id(attn):#x}. Only transformer.blocks[*] (and transformer.vace_blocks[*]) are registered; if you "
        "replaced a module after installation, call transformer.set_attn_processor(CausalWanAttnProcessor()) "
        "again and open a new context."
    )


def writable(tensor: torch.Tensor):
    """In-place writes into cache storage, which may have been allocated under ``torch.inference_mode()`` (a
    rollout run there) and be written outside it later, or the other way round."""
    return torch.inference_mode(tensor.is_inference())


def _join(prefix, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if prefix is None:
        return key, value
    return torch.cat([prefix[0], key], dim=1), torch.cat([prefix[1], value], dim=1)
