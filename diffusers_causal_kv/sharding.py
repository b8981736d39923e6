"""How a transformer's sequence is split across ranks, and the collectives the cache needs (a leaf module).

Under ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N),
cp_plan=causal_cp_plan(transformer))`` diffusers' hooks split the transformer's latent inputs along their height:
each rank holds ``1/N`` of the post-patch rows of every latent frame, so every rank holds the same share of every
frame and the engines' per-frame rules stay exact with ``PassInfo.frame_tokens`` the local count. The split and the
gather are diffusers' own ``ContextParallelSplitHook``/``ContextParallelGatherHook``; the attention of a rank's
queries over every rank's keys is diffusers' Ulysses path in ``dispatch_attention_fn``.

diffusers' own Wan plan splits the flattened tokens (a shard can cut a frame), so :func:`row_split` refuses it
before any work, as it refuses ring attention (its backends return the log-sum-exp, none of which runs on CPU).

:func:`agree` is how ranks commit a chunk together: every rank prepares its commit, then one all-reduce tells each
whether all did, and each writes or aborts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# diffusers names a plan's hooks after the plan's keys, and a plan (a dict) names the transformer itself once: the
# input split. The output gather names it through this attribute, which causal_cp_plan points at the transformer.
ROOT_ALIAS = "causal_cp_root"
SPLIT_HOOK = "cp_input---"
GATHER_HOOK = f"cp_output---{ROOT_ALIAS}"


@dataclass(frozen=True)
class RowSplit:
    """This rank's share of a row-split sequence: rows ``rank * rows .. (rank + 1) * rows - 1`` of every frame's
    post-patch grid, where ``rows`` is the grid height divided by ``degree``."""

    rank: int
    degree: int
    group: object
    """The process group of the ranks sharing the sequence (their commits agree over it)."""


def context_parallel_config(transformer: torch.nn.Module):
    """The transformer's ``ContextParallelConfig`` (``None`` without context parallelism)."""
    config = getattr(transformer, "_parallel_config", None)
    return None if config is None else config.context_parallel_config


def check_split(transformer: torch.nn.Module) -> None:
    """Refuse a context-parallel setup the causal cache cannot run exactly (before any work)."""
    cp = context_parallel_config(transformer)
    if cp is None:
        return
    if cp.ring_degree > 1:
        raise NotImplementedError(
            f"ring attention (ring_degree={cp.ring_degree}) needs attention backends that return the log-sum-exp "
            "(flash, cuDNN), which the causal KV cache does not support; use ContextParallelConfig(ulysses_degree=N)."
        )
    registry = getattr(transformer, "_diffusers_hook", None)
    if registry is None or registry.get_hook(GATHER_HOOK) is None or registry.get_hook(SPLIT_HOOK) is None:
        raise ValueError(
            "this transformer's context-parallel plan is not causal_cp_plan(transformer): diffusers' own Wan plan "
            "splits the flattened tokens, so a rank's shard can cut a latent frame that the causal cache counts "
            "whole; call transformer.enable_parallelism(config=..., cp_plan=causal_cp_plan(transformer))."
        )


def row_split(transformer: torch.nn.Module) -> RowSplit | None:
    """This rank's share of the transformer's sequence under ``causal_cp_plan``, or ``None`` without context
    parallelism (:func:`check_split` has refused every other plan)."""
    cp = context_parallel_config(transformer)
    if cp is None:
        return None
    check_split(transformer)
    mesh = cp._flattened_mesh
    return RowSplit(mesh.get_local_rank(), mesh.size(), mesh.get_group())


def check_rows(split: RowSplit | None, grid_h: int, patch_h: int) -> None:
    """The post-patch rows of a frame must divide evenly across the ranks."""
    if split is not None and grid_h % split.degree:
        raise ValueError(
            f"the post-patch grid height {grid_h} does not divide across {split.degree} context-parallel ranks; use "
            f"a latent height that is a multiple of {split.degree * patch_h} (degree x patch height)."
        )


def agree(ok: bool, groups) -> bool:
    """Whether every rank of every group in ``groups`` reports ``ok`` (one all-reduce per group, in order)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    for group in groups:
        flag = flag.to(collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def collective_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: this rank's CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

