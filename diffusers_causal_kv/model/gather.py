"""Forwards of several rollouts run as one batch: the model layer's half of cross-session batching.

A :class:`GatheredForward` is one forward under its own context, validated and described by the hook as every
forward is (its :class:`~.forward_pass.ForwardPass`, with its own engines, tags, start frame and conditioning
fingerprint). Whoever gathers forwards (``serve.batching``) asks :meth:`GatheredForward.batch_key` which may share a
forward and :func:`run_together` runs them: their inputs joined along the batch, the transformer run once under a
pass whose parts are each forward's own row passes, each forward handed its rows of the output. The processors
already split a batch of tags this way (``tag_passes``): projections, norms and feed-forwards run over the whole
batch; each part attends over its own engine and tag, and stages its own K/V. Each forward then commits its own pass
(atomic per forward), so no engine ever sees another session's rows.

What forwards must share to run together (:meth:`GatheredForward.batch_key`): the transformer, the rows of each part,
the shapes of every per-sample input, every other argument, the grad, inference and autocast modes, and the temporal
RoPE positions, since one forward has one rotary table (as for a batch of tags). Attention runs per part, so the
cached prefixes may differ in length: no padding, no mask and no copy of any prefix is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .forward_pass import ForwardPass

# The transformer's arguments that hold one row per sample (the others are shared by the whole batch).
PER_SAMPLE = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
              "control_hidden_states")


@dataclass(eq=False)
class GatheredForward:
    """One validated cached forward: its transformer, its arguments by name, its pass, and the transformer's forward
    beneath the hook."""

    transformer: torch.nn.Module
    inputs: dict
    forward_pass: ForwardPass
    original: Callable

    @property
    def parts(self) -> list[ForwardPass]:
        """The row passes of this forward, in batch order (one per tag)."""
        return self.forward_pass.tag_passes or [self.forward_pass]

    def run_alone(self):
        """Run this forward by itself."""
        with self.forward_pass.running():
            return self.original(**self.inputs)

    def batch_key(self) -> tuple | None:
        """Forwards with equal keys may run as one batch; ``None``: this one runs alone (mask modes, gradients,
        context parallelism, ``return_dict=True``, inputs that do not hold one row per sample)."""
        p = self.forward_pass
        if (p.info is None and p.tag_passes is None) or p.group is not None or torch.is_grad_enabled() or (
                self.inputs.get("return_dict", True)):
            return None
        rows = self.parts[0].info.batch_size
        batch = rows * len(self.parts)
        per_sample = []
        for name in PER_SAMPLE:
            value = self.inputs.get(name)
            if value is not None and not (isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch):
                return None
            per_sample.append(None if value is None else (tuple(value.shape[1:]), value.dtype, value.device))
        device = self.inputs["hidden_states"].device
        autocast = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
        modes = (torch.is_inference_mode_enabled(), autocast and torch.get_autocast_dtype(device.type))
        shared = tuple((name, _value_key(value)) for name, value in sorted(self.inputs.items())
                       if name not in PER_SAMPLE)
        return (id(self.transformer), rows, tuple(per_sample), shared, modes, tuple(p.positions.tolist()))


def run_together(forwards: Sequence[GatheredForward]) -> list:
    """Run forwards with equal :meth:`~GatheredForward.batch_key` as one forward; each gets its own rows of the
    output (``return_dict=False``: a tuple). Commits are left to each forward's own pass."""
    if len(forwards) == 1:
        return [forwards[0].run_alone()]
    first = forwards[0]
    inputs = dict(first.inputs)
    for name in PER_SAMPLE:
        if inputs.get(name) is not None:
            inputs[name] = torch.cat([f.inputs[name] for f in forwards])
    joined = ForwardPass({}, first.forward_pass.positions, tag_passes=[part for f in forwards for part in f.parts],
                         temporal_rope=first.forward_pass.temporal_rope)
    with joined.running():
        output = first.original(**inputs)
    outputs, start = [], 0
    for forward in forwards:
        stop = start + forward.inputs["hidden_states"].shape[0]
        outputs.append(tuple(o[start:stop] for o in output))
        start = stop
    return outputs


def _value_key(value):
    """A hashable stand-in for an argument shared by the batch, equal for equal values."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype, value.device, tuple(value.flatten().tolist())
    if isinstance(value, dict):
        return "dict", tuple((k, _value_key(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_value_key(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return "object", id(value)
    return value
