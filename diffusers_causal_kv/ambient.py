"""Ambient state: what the code running inside a transformer forward reads without being handed it (a leaf module).

* ``_OPEN_CONTEXTS`` maps each transformer (by ``id``) to its innermost open ``CausalContext``. Contexts for
  different transformers nest freely (a causal generator and a critic in one training step); each thread and each
  asyncio task sees its own (``asyncio.to_thread`` copies them; ``loop.run_in_executor`` does not).
* ``_RUNNING_PASS`` holds the forward pass the attention processors and the RoPE hook serve right now. The
  model-layer hook publishes it (``None`` for a transformer without a context of its own, which then computes the
  stock attention), and a gradient-checkpointing recomputation re-publishes the pass it belongs to.
* ``_COMPILED_PASS`` mirrors ``_RUNNING_PASS`` for code compiled with ``torch.compile``, which cannot trace
  ``ContextVar.get``: a thread-local the hook keeps equal to it, set outside the compiled region.
* ``_HELD_COMMITS`` collects the commits of a ``commits_together()`` block.
* ``_CFG_RANKS`` holds the ``CFGAcrossRanks`` of an open ``with CFGAcrossRanks(group):`` block (guidance split across
  ranks), read by the rollout planner.
* ``_GATHERER`` holds what takes this thread's cached forwards to run them in one batch with other sessions' (the
  scheduler of ``serve.batching``), read by the model-layer hook.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from contextvars import ContextVar, Token
from types import MappingProxyType
from typing import Any

import torch

# Read-only mappings: opening a context publishes a new one, so an outer context's view never changes.
_OPEN_CONTEXTS: ContextVar[Mapping[int, Any]] = ContextVar("causal_kv_open_contexts", default=MappingProxyType({}))
_RUNNING_PASS: ContextVar[Any] = ContextVar("causal_kv_running_pass", default=None)
_HELD_COMMITS: ContextVar[Any] = ContextVar("causal_kv_held_commits", default=None)
_CFG_RANKS: ContextVar[Any] = ContextVar("causal_kv_cfg_ranks", default=None)
_GATHERER: ContextVar[Any] = ContextVar("causal_kv_forward_gatherer", default=None)
_COMPILED_PASS = threading.local()


def open_context(transformer: torch.nn.Module, context) -> Token:
    """Make ``context`` the innermost open context of ``transformer``; returns the token that closes it."""
    return _OPEN_CONTEXTS.set(MappingProxyType({**_OPEN_CONTEXTS.get(), id(transformer): context}))


def close_context(token: Token) -> None:
    _OPEN_CONTEXTS.reset(token)


def current_context(transformer: torch.nn.Module):
    """The innermost open context of ``transformer`` in this thread/task, or ``None``."""
    return _OPEN_CONTEXTS.get().get(id(transformer))


def running_pass():
    """The forward pass the attention code serves right now, or ``None`` (stock attention)."""
    if torch.compiler.is_compiling():
        return getattr(_COMPILED_PASS, "value", None)
    return _RUNNING_PASS.get()


def nothing_published() -> bool:
    """Whether eager and compiled attention code alike would compute stock attention now (no pass published)."""
    return _RUNNING_PASS.get() is None and getattr(_COMPILED_PASS, "value", None) is None


@contextlib.contextmanager
def publishing(forward_pass):
    """Publish ``forward_pass`` (or ``None``: stock attention) to eager and compiled attention code alike."""
    token = _RUNNING_PASS.set(forward_pass)
    previous = getattr(_COMPILED_PASS, "value", None)
    _COMPILED_PASS.value = forward_pass
    try:
        yield
    finally:
        _COMPILED_PASS.value = previous
        _RUNNING_PASS.reset(token)


def held_commits():
    """The list collecting commits in an open ``commits_together()`` block, or ``None``."""
    return _HELD_COMMITS.get()


def holding_commits(held) -> Token:
    return _HELD_COMMITS.set(held)


def release_commits(token: Token) -> None:
    _HELD_COMMITS.reset(token)


def cfg_ranks():
    """The ``CFGAcrossRanks`` of the innermost open block, or ``None`` (guidance on this rank alone)."""
    return _CFG_RANKS.get()


def using_cfg_ranks(cfg) -> Token:
    return _CFG_RANKS.set(cfg)


def release_cfg_ranks(token: Token) -> None:
    _CFG_RANKS.reset(token)


def forward_gatherer():
    """The callable that runs this thread's cached forwards, maybe in a batch with other sessions' forwards, or
    ``None`` (each forward runs on its own)."""
    return _GATHERER.get()


@contextlib.contextmanager
def gathering(gatherer):
    """Hand the cached forwards of the enclosed code to ``gatherer``."""
    token = _GATHERER.set(gatherer)
    try:
        yield
    finally:
        _GATHERER.reset(token)
