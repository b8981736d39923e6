"""One transformer forward under a context, as the model layer runs it: what it tells the engines, what it stages
for the commit, what it remembers for gradient checkpointing, and the two-phase commit over every engine.

Engines never see this record: they get its :class:`~diffusers_causal_kv.kv_cache.PassInfo` and tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..ambient import held_commits, holding_commits, publishing, release_commits
from ..kv_cache import BaseKVCacheEngine, CrossEntry, PassInfo, StagedChunk, owning_engine
from ..masks import CausalMask
from ..sharding import agree


@dataclass(eq=False)
class ForwardPass:
    """A validated forward: its engines and :class:`PassInfo` (cache mode) or its mask (mask modes), the temporal
    RoPE position of each post-patch input frame, and what it stages and remembers."""

    engines: dict[str, BaseKVCacheEngine]
    positions: torch.Tensor
    info: PassInfo | None = None
    mask: CausalMask | None = None
    recomputing: bool = False
    group: object = None
    """The process group of the ranks that split this forward's sequence (context parallelism): they commit
    together."""
    tag_passes: list[ForwardPass] | None = None
    """A batch of several tags (``CausalContext(cache_tag=(...))``): the pass of each tag's group of rows, in batch
    order, each with its own info, staged K/V and memos; this pass itself has no info."""
    temporal_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    """The model's temporal RoPE rows, handed to engines that number window frames at read time; taken when the pass
    is built and again by the RoPE hook (:meth:`take_temporal_rope`), while an offloading hook has rope's buffers
    loaded (offloading to disk empties them outside it)."""
    _staged: dict[int, tuple[BaseKVCacheEngine, StagedChunk]] = field(default_factory=dict, repr=False)
    _memos: dict[int, dict] = field(default_factory=dict, repr=False)

    @property
    def stages(self) -> bool:
        """Whether attention should stage K/V now (a ``store_kv=True`` forward, not its checkpoint recomputation)."""
        return self.info.store_kv and not self.recomputing

    def take_temporal_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Keep the model's temporal RoPE rows for this pass (and each tag's part of a batch)."""
        for part in [self, *(self.tag_passes or [])]:
            part.temporal_rope = (cos, sin)

    def engine_for(self, attn: torch.nn.Module) -> BaseKVCacheEngine:
        return owning_engine(self.engines, attn)

    def memo_for(self, engine: BaseKVCacheEngine) -> dict:
        """The prefixes a grad-enabled pass read from ``engine``, per block: a checkpoint recomputation reads them
        again instead of the engine, which later commits may have changed."""
        return self._memos.setdefault(id(engine), {})

    def stage_self(self, engine, block_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self._staged_for(engine).self_kv[block_idx] = (key.detach(), value.detach())

    def stage_cross(self, engine, block_idx: int, entry: CrossEntry) -> None:
        self._staged_for(engine).cross_kv[block_idx] = entry

    def _staged_for(self, engine) -> StagedChunk:
        return self._staged.setdefault(id(engine), (engine, StagedChunk()))[1]

    def commit(self) -> None:
        """Write what this ``store_kv=True`` forward staged into every engine, or, inside :func:`commits_together`,
        hold it for the block's end."""
        parts = self.tag_passes or [self]  # a batch of tags commits every tag's rows, all or none
        if parts[0].info is None or not parts[0].info.store_kv:
            return
        for part, engine in ((part, engine) for part in parts for engine in self.engines.values()):
            staged = part._staged.get(id(engine), (engine, StagedChunk()))[1]
            if len(staged.self_kv) != engine.num_blocks:
                raise RuntimeError(
                    f"store_kv forward ran self-attention in {len(staged.self_kv)} of {engine.num_blocks} blocks of "
                    f"a {type(engine).__name__}, so nothing was committed. A hook that skips blocks (e.g. diffusers' "
                    "enable_cache) cannot be combined with store_kv=True; disable it for commit passes."
                )
        held = held_commits()
        if held is None or held.closed:
            _commit_passes(parts)
        else:
            held.extend(parts)

    @contextlib.contextmanager
    def running(self, recomputing: bool = False):
        """Publish this pass to the attention code (and flag a checkpoint recomputation) for the enclosed code."""
        parts = [self, *(self.tag_passes or ())]
        previous = [p.recomputing for p in parts]
        for p in parts:
            p.recomputing = recomputing
        try:
            with publishing(self):
                yield self
        finally:
            for p, was in zip(parts, previous):
                p.recomputing = was


def _groups(passes: list[ForwardPass]) -> list:
    """The process groups whose ranks commit ``passes`` together (each once, in the passes' order)."""
    groups = []
    for p in passes:
        if p.group is not None and all(p.group is not g for g in groups):
            groups.append(p.group)
    return groups


def _commit_passes(passes: list[ForwardPass], groups: list | None = None) -> None:
    """Write what ``passes`` staged in two phases, so that a failure (out of memory while allocating a new tag's
    storage) in any engine of any pass leaves every engine as it was: first every engine allocates, then every engine
    writes. With process ``groups`` (default: the passes' context-parallel groups), the ranks agree between the
    phases: a failure on one rank leaves every rank's engines as they were."""
    groups = _groups(passes) if groups is None else groups
    work = [(p.info, engine, staged) for p in passes for engine, staged in p._staged.values()]
    prepared, failure = [], None
    try:
        for info, engine, staged in work:
            prepared.append((info, engine, engine.prepare_commit(info, staged)))
    except BaseException as error:
        failure = error
    refused = bool(groups) and not agree(failure is None, groups)
    if failure is not None or refused:
        for info, engine, created in reversed(prepared):
            engine.abort_commit(info, created)
        if failure is not None:
            raise failure
        raise RuntimeError(
            "commit refused on every rank: another rank failed to prepare its part of this chunk's commit (its own "
            "error says why), so no rank wrote it; fix that rank's error and run the commit again on every rank."
        )
    for info, engine, staged in work:
        engine.commit(info, staged)


@contextlib.contextmanager
def commits_together(group=None):
    """Hold the commits of the ``store_kv=True`` forwards run in the block and write them all when it exits without
    an error, or none of them: the rollout planner commits a chunk on every tag (``"pos"``, ``"neg"``) this way, so
    a failure on one tag cannot leave the tags at different frames. Each forward must use its own tag (a held commit
    is not visible to later forwards of the block).

    ``group``: a process group whose ranks commit their blocks together (guidance across ranks: each rank commits
    its own tag); a rank whose block raises tells the others, so none commits. It must contain the ranks of every
    context-parallel group of the forwards held (default: those groups)."""
    if held_commits() is not None:  # nested: the outermost block commits
        yield
        return
    held = _HeldCommits()
    token = holding_commits(held)
    try:
        yield
    except BaseException:
        if group is not None:
            agree(False, [group])  # the peers wait in their own agreement: none of them commits
        raise
    finally:
        release_commits(token)
        held.closed = True  # a context copied inside the block (a task it started) then commits at once
    _commit_passes(held, None if group is None else [group])


class _HeldCommits(list):
    closed = False


# The same prompt tensor is passed to every forward of a rollout: remember its fingerprint while it is alive and
# unmodified (its version counter unchanged), so the reductions and their host sync run once per tensor.
_FINGERPRINTS = WeakIdKeyDictionary()


def conditioning_fingerprint(tensors, rows: tuple[int, int] | None = None) -> tuple:
    """A value fingerprint of the conditioning inputs (shape, dtype and three float64 reductions each), or of their
    batch rows ``rows`` (``(start, stop)``: one tag of a batch of tags), equal to that of those rows passed alone."""
    return tuple(_fingerprint(t, rows) for t in tensors)


def _fingerprint(tensor: torch.Tensor | None, rows: tuple[int, int] | None):
    if tensor is None:
        return None
    part = tensor if rows is None else tensor[rows[0]:rows[1]]
    if tensor.is_inference():  # no version counter to tell an in-place edit by: reduce it every time
        return _reduce(part)
    known = _FINGERPRINTS.get(tensor)
    if known is None or known[0] != tensor._version:
        known = (tensor._version, {})
        _FINGERPRINTS[tensor] = known
    if rows not in known[1]:
        known[1][rows] = _reduce(part)
    return known[1][rows]


def _reduce(tensor: torch.Tensor) -> tuple:
    flat = tensor.detach().flatten().to(torch.float64)
    ramp = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(7919)
    sums = torch.stack([flat.sum(), flat.square().sum(), (flat * ramp).sum()])
    return tuple(tensor.shape), tensor.dtype, tuple(sums.tolist())
