"""Causal rollouts on several devices: diffusers' context parallelism with a frame-aligned plan, and classifier-free
guidance across ranks.

Context parallelism (the sequence of every forward split across ``N`` ranks)::

    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N), cp_plan=causal_cp_plan(transformer))

``causal_cp_plan`` splits the transformer's latent inputs (and VACE control latents) along their height, so that
each rank holds ``1/N`` of the rows of every latent frame; diffusers' Ulysses attention then attends each head over
every rank's keys. Each rank's self-attention cache holds its rows (``1/N`` of the single-device bytes); the
cross-attention entries are replicated. Commits agree across the ranks: a failure on one leaves every rank's cache as
it was.

Guidance across ranks (the ``"pos"`` and ``"neg"`` passes of a chunk on two ranks at once)::

    with CFGAcrossRanks(group):
        causal_rollout(transformer, noise, text, negative_prompt_embeds=negative, guidance_scale=5.0, ...)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .ambient import release_cfg_ranks, using_cfg_ranks
from .positions import install_rope_hook
from .sharding import ROOT_ALIAS


def causal_cp_plan(transformer: torch.nn.Module) -> dict:
    """A context-parallel plan for ``transformer.enable_parallelism(config=..., cp_plan=...)`` under which the causal
    cache stays exact: every latent frame's post-patch rows are divided evenly across the ranks.

    The plan splits the transformer's ``hidden_states`` (and a VACE model's ``control_hidden_states``) along their
    height before the forward and gathers the output's height after it; between the two, every module sees this
    rank's rows (``rope`` too: the plugin's RoPE hook, registered here, places them at the rank's rows of the grid).
    The latent height must be a multiple of ``N x patch height``; forwards need ``return_dict=False``. The plan's
    output entry names the transformer through the attribute ``causal_cp_root``, which this function points at the
    transformer itself (a diffusers plan names each module once, and the transformer is both split and gathered).
    """
    split = ContextParallelInput(split_dim=3, expected_dims=5)
    inputs = {"hidden_states": split}
    if hasattr(transformer, "vace_blocks"):
        inputs["control_hidden_states"] = split
    transformer.__dict__[ROOT_ALIAS] = transformer  # a plain attribute: no submodule, nothing in the state dict
    install_rope_hook(transformer)
    return {"": inputs, ROOT_ALIAS: ContextParallelOutput(gather_dim=3, expected_dims=5)}


class CFGAcrossRanks:
    """Classifier-free guidance with the two passes of each chunk on two ranks at once.

    Inside ``with CFGAcrossRanks(group):`` the rollout helpers, the pipeline and streams run, on the rank of group
    rank 0, only the positive tag (and hold only its cache) and, on group rank 1, only ``"neg"``; each chunk's two
    predictions are all-gathered so that every rank steps with the guided one, and every rank commits its own tag, all
    or none (:func:`~diffusers_causal_kv.commits_together` over ``commit_group``).

    Args:
        group: a process group of exactly two ranks (default the whole world). On a 2-D mesh combined with context
            parallelism, the mesh's ``"cfg"`` dimension: each rank's peer there holds the same rows of the sequence.
        commit_group: the ranks that commit each chunk together; default ``group``. On a 2-D mesh, the whole mesh
            (``torch.distributed.group.WORLD``), which contains every context-parallel group.
    """

    def __init__(self, group=None, commit_group=None) -> None:
        group = dist.group.WORLD if group is None else group
        size = group.size()
        if size != 2:
            raise ValueError(
                f"CFGAcrossRanks needs a process group of exactly 2 ranks (one per guidance tag), got {size}; pass "
                "torch.distributed.new_group([a, b]) or a device mesh's 'cfg' dimension (mesh['cfg'].get_group())."
            )
        self.group = group
        self.commit_group = group if commit_group is None else commit_group
        self.negative = group.rank() == 1
        self._tokens = []

    def tag(self, positive_tag: str) -> str:
        """The tag this rank runs and caches (``positive_tag`` or ``"neg"``)."""
        return "neg" if self.negative else positive_tag

    def combine(self, local: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The guided prediction ``neg + s * (pos - neg)`` from this rank's ``local`` prediction and its peer's."""
        gathered = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(gathered, local.contiguous(), group=self.group)
        cond, uncond = gathered
        return uncond + guidance_scale * (cond - uncond)

    def __enter__(self) -> CFGAcrossRanks:
        self._tokens.append(using_cfg_ranks(self))
        return self

    def __exit__(self, *exc) -> None:
        release_cfg_ranks(self._tokens.pop())

