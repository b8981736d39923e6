"""Gradient checkpointing under a context: recomputations see the pass their forward saw.

Checkpointed blocks are recomputed during ``backward()``, after the ``with CausalContext(...)`` block has exited and
maybe after more chunks were committed. :class:`PassAwareCheckpoint` reads the running pass when a block runs (so
concurrent forwards in other threads or sessions each get their own), and its ``context_fn`` re-publishes that pass
for every recomputation (a second ``backward(retain_graph=True)`` recomputes again); the pass's memo then gives the
prefixes the forward read.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from ..ambient import running_pass


class PassAwareCheckpoint:
    """The transformer's ``_gradient_checkpointing_func`` once a forward under a context checkpoints its blocks.

    Without a running pass it calls the function it replaced. It is installed once and never swapped back, because
    diffusers rebuilds the function on every ``enable_gradient_checkpointing()`` call; the hook re-installs it then.
    """

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, block: torch.nn.Module, *args):
        p = running_pass()
        if p is None:
            return self.inner(block, *args)
        return torch.utils.checkpoint.checkpoint(
            block.__call__, *args, use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), _Recomputing(p)),
        )


class _Recomputing:
    """Re-enterable: publishes the pass, flagged as a recomputation, each time a recomputation runs."""

    def __init__(self, forward_pass):
        self.forward_pass, self._open = forward_pass, []

    def __enter__(self):
        running = self.forward_pass.running(recomputing=True)
        running.__enter__()
        self._open.append(running)

    def __exit__(self, *exc_info):
        return self._open.pop().__exit__(*exc_info)


def route_checkpointing(transformer: torch.nn.Module) -> None:
    """Install :class:`PassAwareCheckpoint` if the transformer checkpoints its blocks and does not use it yet."""
    if getattr(transformer, "gradient_checkpointing", False) and not isinstance(
        transformer._gradient_checkpointing_func, PassAwareCheckpoint
    ):
        transformer._gradient_checkpointing_func = PassAwareCheckpoint(transformer._gradient_checkpointing_func)


def unroute_checkpointing(transformer: torch.nn.Module) -> None:
    func = getattr(transformer, "_gradient_checkpointing_func", None)
    if isinstance(func, PassAwareCheckpoint):
        transformer._gradient_checkpointing_func = func.inner
