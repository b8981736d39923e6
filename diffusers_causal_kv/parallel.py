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

Either way every rank must hold the same inputs: the same noise (the same generator seed on every rank, not one per
rank), conditioning and schedule. :func:`check_ranks_agree` compares them when a rollout starts, with one all-gather
of a few checksums per process group, and refuses a rollout whose ranks differ before any cache is cleared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .ambient import cfg_ranks, release_cfg_ranks, using_cfg_ranks
from .positions import install_rope_hook
from .sharding import ROOT_ALIAS, collective_device, row_split


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



def check_ranks_agree(planner, sampling, sizes, latent_shape: Sequence[int] | None, latents: torch.Tensor | None,
                      device: torch.device | None) -> None:
    """Refuse a rollout starting under context parallelism or ``CFGAcrossRanks`` whose ranks do not hold the same
    inputs, naming each rank that differs and what differs; nothing happens without either.

    ``planner`` and ``sampling`` are the rollout's :class:`~diffusers_causal_kv.RolloutPlanner` and
    :class:`~diffusers_causal_kv.session.Sampling` (read here, not imported: they live in the layers above);
    ``sizes`` its chunk plan (compared when it is a list), ``latent_shape`` / ``latents`` / ``device`` as the
    session takes them. Every rank of each group (the guidance pair and its commit group, each expert's
    context-parallel group) all-gathers one 64-bit checksum per input; tensors are hashed whole, on the CPU."""
    cfg = cfg_ranks()
    groups = [] if cfg is None else [cfg.commit_group, cfg.group]
    groups += [split.group for split in map(row_split, (e.transformer for e in planner.experts)) if split is not None]
    groups = [group for i, group in enumerate(groups) if all(group is not other for other in groups[:i])]
    if not groups:
        return
    inputs = _rollout_inputs(planner, sampling, sizes, latent_shape, latents, device)
    local = torch.tensor([_checksum(value) for value in inputs.values()], dtype=torch.int64)
    for group in groups:
        (first, expected), *others = gathered_checksums(local, group)
        differing = []
        for rank, sums in others:
            names = [name for name, a, b in zip(inputs, sums.tolist(), expected.tolist()) if a != b]
            if names:
                differing.append(f"rank {rank} differs from rank {first} in its {', '.join(names)}")
        if differing:
            raise ValueError(
                "the ranks of a rollout must hold the same noise, conditioning and schedule, but "
                f"{'; '.join(differing)}. Context parallelism splits one sequence and CFGAcrossRanks one guided step "
                "across the ranks, so each rank must be given the same inputs: seed every rank's generator alike (not "
                "by rank), and pass every rank the same prompts, latents and sampling settings."
            )


def gathered_checksums(local: torch.Tensor, group) -> list[tuple[int, torch.Tensor]]:
    """``(global rank, checksums)`` of every rank of ``group``, in group order (one all-gather)."""
    device = collective_device(group)
    gathered = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local.to(device), group=group)
    return [(dist.get_global_rank(group, i), sums.cpu()) for i, sums in enumerate(gathered)]


def _rollout_inputs(planner, sampling, sizes, latent_shape, latents, device) -> dict[str, object]:
    """What every rank must hold alike, by the name the error gives it (the same names, in the same order, on every
    rank, whatever is missing: ``None`` is hashed too)."""
    noise, scheduler = planner.noise, sampling.scheduler
    generators = noise.generator if noise.per_sample else [noise.generator]
    if noise.generator is None:  # the default generator of the device the noise is drawn on
        on_cuda = device is not None and torch.device(device).type == "cuda"
        states = [torch.cuda.get_rng_state(device) if on_cuda else torch.get_rng_state()]
    else:
        states = [g.get_state() for g in generators]
    return {
        "initial latents (latents=)": latents,
        "random generator state (generator=)": states,
        "prompt_embeds": planner.prompts[planner.cache_tag],
        "negative_prompt_embeds": planner.prompts.get("neg"),
        "image embeddings": planner.image_embeds,
        "condition latents": planner.per_frame["condition_latents"],
        "control latents": planner.per_frame["control_latents"],
        "control scale": planner.control_scale,
        "first-frame latents": planner.first_frame_latents,
        "sampling schedule (timesteps, shift, scheduler, context noise)": (
            sampling.sigmas, sampling.num_inference_steps, sampling.context_noise, sampling.context_noise_mode,
            None if scheduler is None else (type(scheduler).__name__, dict(scheduler.config))),
        "chunk plan and latent shape": (list(sizes) if isinstance(sizes, Sequence) else None, latent_shape),
        "guidance scales and expert boundary": (planner.cache_tag, planner.use_cfg, planner.boundary,
                                               [e.guidance_scale for e in planner.experts]),
    }


def _checksum(value) -> int:
    """A 64-bit hash of ``value``: tensors by dtype, shape and bytes; sequences item by item; the rest by ``repr``."""
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, value)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _feed(digest, value) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().reshape(-1).contiguous()
        digest.update(repr((tensor.dtype, tuple(value.shape))).encode())
        digest.update(tensor.view(torch.uint8).cpu().numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(repr(value).encode())
