"""The context layer: one forward pass's rollout metadata, published through context variables.

Two context variables carry it:

* ``_OPEN_CONTEXTS`` maps each transformer (by ``id``) to its innermost open :class:`CausalContext`. Contexts for
  different transformers nest freely (a causal generator and a critic in one training step); each thread and each
  asyncio task sees its own.
* ``_RUNNING_PASS`` holds the :class:`ForwardPass` of the transformer forward in flight. The model-layer hook sets
  it (to ``None`` for a transformer without a context of its own, which then computes the stock attention), and a
  gradient-checkpointing recomputation re-publishes the pass it belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from .kv_cache.base import BaseKVCacheEngine, CrossEntry
    from .masks import CausalMask

MODES = ("cache", "block_causal", "teacher_forcing")

# Read-only mappings: opening a context publishes a new one, so an outer context's view never changes.
_OPEN_CONTEXTS: ContextVar[Mapping[int, CausalContext]] = ContextVar(
    "causal_kv_open_contexts", default=MappingProxyType({})
)
_RUNNING_PASS: ContextVar[ForwardPass | None] = ContextVar("causal_kv_running_pass", default=None)
_DEFERRED_COMMITS: ContextVar[_HeldCommits | None] = ContextVar("causal_kv_deferred_commits", default=None)


class CausalContext:
    """Run forwards of ``transformer`` causally against its KV cache.

    Fields:
        transformer: the Wan transformer the context applies to; forwards of other transformers are unaffected.
        start_frame (int): latent frame at which this forward's chunk starts. It gives the chunk's temporal RoPE
            positions (``start_frame, start_frame + 1, ...``) and must continue the tag's cache: it equals the
            engine's ``next_frame(cache_tag)`` (for append-only engines, the number of cached frames), on
            denoising and commit passes alike.
        cache_tag (str): namespace of the cache entries read and written, e.g. ``"pos"``/``"neg"`` for CFG.
        store_kv (bool): when True, the forward's self K/V (and, the first time, the cross-attention K/V) are
            committed to the cache once the forward returns. A forward that raises commits nothing.
        cache_engines (dict[str, BaseKVCacheEngine]): the engines read and written, one per branch (``"main"``,
            plus ``"vace"`` for VACE). Defaults to ``transformer.kv_cache_engines``; pass your own map to run one
            rollout per user session over one set of weights. Resolved and registered when the context opens.
        mode (str): how self-attention sees other frames.

            * ``"cache"`` (default): the forward is one chunk of a rollout; it attends over the engine's cached
              prefix and itself (inference, self-forcing).
            * ``"block_causal"``: the forward is a whole sequence, self-attention is masked with
              :func:`~diffusers_causal_kv.block_causal_mask` and no cache is read or written (diffusion forcing /
              causal pretraining, with per-chunk noise levels passed as per-token timesteps).
            * ``"teacher_forcing"``: the forward is ``[clean context | noisy frames]`` (two halves of the same length
              and chunk schedule), masked with :func:`~diffusers_causal_kv.teacher_forcing_mask`; both halves get the
              same temporal RoPE positions, ``start_frame ...``, so noisy chunk *k* sits at clean chunk *k*'s
              positions. No cache is involved.
        chunk_frames (int | list[int]): mask modes: the chunk schedule (of one half, for teacher forcing), with the
            remainder rule of :func:`~diffusers_causal_kv.chunk_schedule`. The mask is built for each forward.
        window_frames (int | None), sink_frames (int): mask modes: restrict each chunk to a sliding window of
            ``window_frames`` frames plus the first ``sink_frames`` frames (see :mod:`diffusers_causal_kv.masks`).
        mask (CausalMask): mask modes: a prebuilt mask instead of ``chunk_frames``/``window_frames``/
            ``sink_frames`` (reuse one across training steps; a FlexAttention ``BlockMask`` is built once). Its
            ``kind`` must be the mode and its size the forward's sequence.

    The context is a re-usable, non-reentrant context manager. Opening it completes installation (engine
    creation, module registration, hooks) if ``transformer.set_attn_processor(CausalWanAttnProcessor())`` was
    called but no context has been opened yet.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        *,
        start_frame: int = 0,
        cache_tag: str = "pos",
        store_kv: bool = False,
        cache_engines: dict[str, BaseKVCacheEngine] | None = None,
        mode: str = "cache",
        chunk_frames: int | list[int] | None = None,
        window_frames: int | None = None,
        sink_frames: int = 0,
        mask: CausalMask | None = None,
    ) -> None:
        if isinstance(start_frame, bool) or not isinstance(start_frame, int):
            raise TypeError(f"start_frame must be an int (a latent frame index), got {type(start_frame).__name__}.")
        if start_frame < 0:
            raise ValueError(f"start_frame must be >= 0, got {start_frame}; pass the latent frame the chunk starts at.")
        if not isinstance(cache_tag, str):
            raise TypeError(f"cache_tag must be a str such as 'pos' or 'neg', got {type(cache_tag).__name__}.")
        _check_mode(mode, store_kv, chunk_frames, window_frames, sink_frames, mask)
        self.transformer = transformer
        self.start_frame = start_frame
        self.cache_tag = cache_tag
        self.store_kv = bool(store_kv)
        self._requested_engines = cache_engines
        self.mode = mode
        self.chunk_frames = chunk_frames
        self.window_frames = window_frames
        self.sink_frames = sink_frames
        self.mask = mask
        self.cache_engines: dict[str, BaseKVCacheEngine] | None = None
        self._token = None

    def __enter__(self) -> CausalContext:
        if self._token is not None:
            raise RuntimeError("This CausalContext is already open; create a new CausalContext to nest one.")
        from .model import prepare_transformer  # the model layer imports this module

        self.cache_engines = prepare_transformer(self.transformer, self._requested_engines)
        self._token = _OPEN_CONTEXTS.set(MappingProxyType({**_OPEN_CONTEXTS.get(), id(self.transformer): self}))
        return self

    def __exit__(self, *exc_info) -> None:
        _OPEN_CONTEXTS.reset(self._token)
        self._token = None

    def resolve_registered_engine(self, attn: torch.nn.Module) -> BaseKVCacheEngine:
        """The engine of this context that registered ``attn``; raises if none did."""
        if self.cache_engines is None:
            raise RuntimeError(
                "resolve_registered_engine() needs an open context: use it inside `with CausalContext(...)`."
            )
        for engine in self.cache_engines.values():
            if engine.owns(attn):
                return engine
        raise RuntimeError(
            f"No KV-cache engine of this CausalContext registered the attention module {type(attn).__name__} at "
            f"{id(attn):#x}. Only transformer.blocks[*] (and transformer.vace_blocks[*]) are registered; if you "
            "replaced a module after installation, call transformer.set_attn_processor(CausalWanAttnProcessor()) "
            "again and open a new context."
        )

    def __repr__(self) -> str:
        return (
            f"CausalContext({type(self.transformer).__name__}, start_frame={self.start_frame}, "
            f"cache_tag={self.cache_tag!r}, store_kv={self.store_kv}, mode={self.mode!r})"
        )


def _check_mode(mode, store_kv, chunk_frames, window_frames, sink_frames, mask) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    mask_options = {"chunk_frames": chunk_frames, "window_frames": window_frames, "sink_frames": sink_frames or None,
                    "mask": mask}
    if mode == "cache":
        given = [name for name, value in mask_options.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply to the mask modes 'block_causal' and 'teacher_forcing'; in "
                "mode='cache' the engine decides what a chunk attends to (use a rolling engine for a window)."
            )
        return
    if store_kv:
        raise ValueError(
            f"mode={mode!r} runs the whole sequence with a mask and never touches the KV cache, so store_kv=True "
            "cannot apply; commit chunks with mode='cache' (the default)."
        )
    if (mask is None) == (chunk_frames is None):
        raise ValueError(
            f"mode={mode!r} needs exactly one of chunk_frames (the mask is built per forward) or mask (a prebuilt "
            "CausalMask)."
        )
    if mask is not None:
        if window_frames is not None or sink_frames:
            raise ValueError("window_frames/sink_frames are part of a prebuilt mask; pass them to its builder.")
        if getattr(mask, "kind", None) != mode:
            raise ValueError(
                f"mask is {mask!r} but mode={mode!r}; build it with the {mode}_mask() builder or change the mode."
            )


def get_current_context(transformer: torch.nn.Module) -> CausalContext | None:
    """The innermost open :class:`CausalContext` of ``transformer`` in this thread/task, or ``None``."""
    return _OPEN_CONTEXTS.get().get(id(transformer))


def running_pass() -> ForwardPass | None:
    """The :class:`ForwardPass` the attention processors serve right now, or ``None`` (stock attention)."""
    return _RUNNING_PASS.get()


@dataclass
class StagedKV:
    """What one ``store_kv=True`` forward produced for one engine, written when the forward returns."""

    self_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cross_kv: dict[int, CrossEntry] = field(default_factory=dict)
    created_tag: bool = False
    """Set by ``prepare_commit``: the commit creates the tag (so aborting it forgets the tag)."""


@dataclass(eq=False)
class ForwardPass:
    """One transformer forward under a :class:`CausalContext`: its validated shapes and what it stages.

    Built by the model-layer hook after validation. ``frame_tokens`` is the number of tokens per latent frame
    (post-patch height x width); ``num_frames`` the post-patch latent frames of the input (the chunk, or in a mask
    mode the whole sequence).
    """

    context: CausalContext
    num_frames: int
    frame_tokens: int
    batch_size: int
    dtype: torch.dtype
    device: torch.device
    conditioning: tuple[torch.Tensor | None, ...]
    mask: CausalMask | None = None
    """The self-attention mask of a mask mode; ``None`` in mode ``"cache"``."""
    positions: torch.Tensor | None = None
    """Temporal RoPE position of each post-patch latent frame of the input (set once the pass is validated)."""
    recomputing: bool = False
    _staged: dict[int, tuple[BaseKVCacheEngine, StagedKV]] = field(default_factory=dict, repr=False)
    _prefixes: dict[tuple[int, int], tuple | None] = field(default_factory=dict, repr=False)
    _fingerprint: tuple | None = field(default=None, repr=False)
    weights_state: Callable[[], tuple] = field(default=tuple, repr=False)
    """Returns the state of everything that computes cached K/V (see ``model.projection_state``); compared by
    the engines against the state a tag was filled with."""
    _weights: tuple | None = field(default=None, repr=False)

    @property
    def start_frame(self) -> int:
        return self.context.start_frame

    @property
    def cache_tag(self) -> str:
        return self.context.cache_tag

    @property
    def store_kv(self) -> bool:
        return self.context.store_kv

    @property
    def engines(self) -> list[BaseKVCacheEngine]:
        return list(self.context.cache_engines.values())

    def staged_for(self, engine: BaseKVCacheEngine) -> StagedKV:
        return self._staged.setdefault(id(engine), (engine, StagedKV()))[1]

    def remembered_prefix(self, engine: BaseKVCacheEngine, block_idx: int, read: Callable[[], tuple | None]):
        """``read()`` the first time, the same tensors on every later call (a checkpoint recomputation)."""
        key = (id(engine), block_idx)
        if key not in self._prefixes:
            self._prefixes[key] = read()
        return self._prefixes[key]

    def conditioning_fingerprint(self) -> tuple:
        """A value fingerprint of the conditioning inputs (shape, dtype and three float64 reductions each)."""
        if self._fingerprint is None:
            self._fingerprint = tuple(_fingerprint(t) for t in self.conditioning)
        return self._fingerprint

    def weights_fingerprint(self) -> tuple:
        """``weights_state()``, computed once per pass."""
        if self._weights is None:
            self._weights = self.weights_state()
        return self._weights

    def commit(self) -> None:
        """Write what this ``store_kv=True`` forward staged into every engine, or, inside :func:`commits_together`,
        hold it for the block's end."""
        if not self.store_kv:
            return
        self._check_staged()
        deferred = _DEFERRED_COMMITS.get()
        if deferred is None or deferred.closed:
            _commit_passes([self])
        else:
            deferred.append(self)

    def _check_staged(self) -> None:
        for engine in self.engines:
            staged = self._staged.get(id(engine), (engine, None))[1]
            blocks = engine.num_blocks
            if staged is None or len(staged.self_kv) != blocks:
                got = 0 if staged is None else len(staged.self_kv)
                raise RuntimeError(
                    f"store_kv forward ran self-attention in {got} of {blocks} blocks of a {type(engine).__name__}, "
                    "so nothing was committed. A hook that skips blocks (e.g. diffusers' enable_cache) cannot be "
                    "combined with store_kv=True; disable it for commit passes."
                )

    @contextlib.contextmanager
    def running(self, recomputing: bool = False):
        """Publish this pass to the processors (and flag a checkpoint recomputation) for the enclosed code."""
        token = _RUNNING_PASS.set(self)
        previous, self.recomputing = self.recomputing, recomputing
        try:
            yield self
        finally:
            self.recomputing = previous
            _RUNNING_PASS.reset(token)


def _commit_passes(passes: list[ForwardPass]) -> None:
    """Write what ``passes`` staged in two phases, so that a failure (out of memory while allocating a new tag's
    storage) in any engine of any pass leaves every engine as it was: first every engine allocates, then every engine
    writes."""
    work = [(p, engine, staged) for p in passes for engine, staged in p._staged.values()]
    prepared = []
    try:
        for p, engine, staged in work:
            engine.prepare_commit(p, staged)
            prepared.append((p, engine, staged))
    except BaseException:
        for p, engine, staged in reversed(prepared):
            engine.abort_commit(p, staged)
        raise
    for p, engine, staged in work:
        engine.commit(p, staged)


@contextlib.contextmanager
def commits_together():
    """Hold the commits of the ``store_kv=True`` forwards run in the block and write them all when it exits without
    an error, or none of them: the rollout helpers commit a chunk on every tag (``"pos"``, ``"neg"``) this way, so a
    failure on one tag cannot leave the tags at different frames. Each forward must use its own tag (a held commit
    is not visible to later forwards of the block)."""
    outer = _DEFERRED_COMMITS.get()
    if outer is not None:  # nested: the outermost block commits
        yield
        return
    held = _HeldCommits()
    token = _DEFERRED_COMMITS.set(held)
    try:
        yield
    finally:
        _DEFERRED_COMMITS.reset(token)
        held.closed = True  # a context copied inside the block (a task it started) then commits at once
    _commit_passes(held)


class _HeldCommits(list):
    closed = False


@contextlib.contextmanager
def no_running_pass():
    """Run the enclosed transformer forward with stock attention (it has no context of its own)."""
    token = _RUNNING_PASS.set(None)
    try:
        yield
    finally:
        _RUNNING_PASS.reset(token)


# The same prompt tensor is passed to every forward of a rollout: remember its fingerprint while it is alive and
# unmodified (its version counter unchanged), so the reductions and their host sync run once per tensor.
_FINGERPRINTS = WeakIdKeyDictionary()


def _fingerprint(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    known = _FINGERPRINTS.get(tensor)
    if known is not None and known[0] == tensor._version:
        return known[1]
    flat = tensor.detach().flatten().to(torch.float64)
    ramp = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(7919)
    sums = torch.stack([flat.sum(), flat.square().sum(), (flat * ramp).sum()])
    fingerprint = tuple(tensor.shape), tensor.dtype, tuple(sums.tolist())
    _FINGERPRINTS[tensor] = (tensor._version, fingerprint)
    return fingerprint
