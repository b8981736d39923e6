"""The causal sampling loops, each a :class:`~diffusers_causal_kv.session.RolloutSession` over a
:class:`~diffusers_causal_kv.planner.RolloutPlanner`: inference (Self-Forcing / CausVid) and the self-forcing
training rollout.

For each chunk of latent frames: denoise it against the cached prefix (few-step sampling over a timestep list, or
any diffusers flow-matching scheduler, reset for every chunk), then run one commit pass on the clean chunk
(``store_kv=True``, with the timestep label ``context_noise``, re-noised to it or not by ``context_noise_mode``) so
the next chunks attend to it.

:func:`causal_rollout` runs everything without gradients. :func:`self_forcing_rollout` is the training variant:
each chunk keeps gradients for one denoising step only (Self-Forcing's stochastic exit step), the commit passes run
without gradients, and the returned latents carry the autograd graph for a DMD-style loss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .causal_config import DEFAULTS
from .masks import chunk_schedule
from .planner import RolloutPlanner
from .rolling_forcing import make_session
from .session import RolloutSession, Sampling


@dataclass
class RolloutOutput:
    """Result of :func:`causal_rollout` and :func:`self_forcing_rollout`."""

    latents: torch.Tensor
    """Clean latents ``[batch, channels, frames, height, width]``."""
    chunk_sizes: list[int]
    """Latent frames per chunk, in order."""
    chunk_seconds: list[float] = field(default_factory=list)
    """Wall-clock seconds per chunk (denoising and commit)."""
    exit_steps: list[int] | None = None
    """:func:`self_forcing_rollout`: per chunk, the index in ``timesteps`` of the step that kept gradients."""


@torch.no_grad()
def causal_rollout(
    model,
    noise: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    negative_prompt_embeds: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    chunk_frames: int | Sequence[int] = DEFAULTS.chunk_frames,
    timesteps: Sequence[float] = DEFAULTS.timesteps,
    shift: float = DEFAULTS.shift,
    scheduler=None,
    num_inference_steps: int | None = None,
    context_noise: float = 0.0,
    context_noise_mode: str = "label",
    condition_latents: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,  # Wan2.1 I2V
    control_latents: torch.Tensor | None = None, control_scale: torch.Tensor | None = None,  # VACE
    cache_engines: dict | None = None,
    generator: torch.Generator | None = None,
    attention_kwargs: dict | None = None,
    guidance_scale_2: float | None = None, boundary_ratio: float | None = None,  # Wan2.2 A14B
    expand_timesteps: bool | None = None, first_frame_latents: torch.Tensor | None = None,  # Wan2.2 TI2V
    progress: bool = True,
    continue_cache: bool = False,
    cfg_batch: bool = True,
    sampler: str = DEFAULTS.sampler,
    first_chunk_timesteps: Sequence[float] | None = None,
) -> RolloutOutput:
    """Generate ``noise.shape[2]`` latent frames chunk by chunk with the KV cache.

    Args:
        model: a Wan (or Wan VACE) transformer with ``CausalWanAttnProcessor`` installed, or a pipeline holding one.
        noise: initial noise ``[batch, channels, frames, height, width]`` for every frame.
        prompt_embeds / negative_prompt_embeds: text embeddings; with ``guidance_scale > 1`` and a negative prompt,
            classifier-free guidance runs the two through cache tags ``"pos"`` and ``"neg"``.
        chunk_frames: chunk size (remainder absorbed by the first chunk) or an explicit list of chunk sizes.
        timesteps / shift: few-step sampling (Self-Forcing): predict x0 from the flow at each timestep, re-noise it
            to the next one. Ignored when ``scheduler`` is given.
        scheduler / num_inference_steps: multi-step sampling with a diffusers flow-matching scheduler, whose
            ``set_timesteps`` is called again for every chunk.
        context_noise: timestep label (0..1000) of the commit pass of each clean chunk.
        context_noise_mode: ``"label"`` (default) commits the clean chunk with that label, as Self-Forcing's,
            CausVid's and LongLive's inference do; ``"renoise"`` first noises it to that level, as their training
            does (the same at ``context_noise=0``).
        condition_latents: Wan2.1 I2V condition (mask and image latents), ``[batch, 20, frames, height, width]``,
            concatenated to each chunk's latents along channels.
        image_embeds: Wan2.1 I2V image-encoder embeddings, passed to every forward.
        control_latents / control_scale: VACE control latents ``[batch, vace_in_channels, frames, height, width]``,
            sliced per chunk like the noise, and the per-VACE-layer scale (``[len(vace_layers)]``, default ones).
        cache_engines: engine map for this rollout (one per user session); default ``transformer.kv_cache_engines``.
        generator: random generator for re-noising.
        attention_kwargs: passed to every forward (e.g. ``{"scale": 0.5}``, the LoRA scale).
        guidance_scale_2 / boundary_ratio: a two-expert Wan2.2 A14B pipeline (``transformer`` above the boundary
            timestep, ``transformer_2`` below it; see :class:`~diffusers_causal_kv.RolloutPlanner`).
        expand_timesteps / first_frame_latents: Wan2.2 TI2V's per-token timesteps, and its image-to-video first
            frame (the encoded image; default the pipeline's ``config.expand_timesteps``).
        progress: show a tqdm progress bar over chunks.
        continue_cache: keep the cache instead of clearing it, and start at the frame the ``"main"`` engine's
            ``"pos"`` tag continues at (after :func:`~diffusers_causal_kv.refill.prefill`, a re-cache or an
            earlier rollout); the per-frame inputs still cover the generated frames only.
        cfg_batch: with guidance, run the ``"pos"`` and ``"neg"`` passes of a chunk as one forward over a batch of
            the two tags (default; see :class:`~diffusers_causal_kv.RolloutPlanner`), ``False`` for two forwards.
        sampler: ``"chunkwise"`` (each chunk through every timestep, then committed) or ``"rolling_forcing"`` (a
            window of as many chunks as timesteps denoised jointly, :mod:`~diffusers_causal_kv.rolling_forcing`).
        first_chunk_timesteps: the first chunk's own few-step timesteps (Causal-Forcing++'s 1- and 2-step models
            denoise their first frame in 4 steps); default ``timesteps``.
    """
    planner = RolloutPlanner(model, prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                             guidance_scale=guidance_scale, image_embeds=image_embeds,
                             condition_latents=condition_latents, control_latents=control_latents,
                             control_scale=control_scale, cache_engines=cache_engines, generator=generator,
                             attention_kwargs=attention_kwargs, guidance_scale_2=guidance_scale_2,
                             boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps,
                             first_frame_latents=first_frame_latents, cfg_batch=cfg_batch)
    sampling = Sampling.create(timesteps, shift, context_noise, context_noise_mode, scheduler, num_inference_steps,
                               sampler, first_chunk_timesteps)
    sizes = chunk_schedule(noise.shape[2], chunk_frames)
    session = make_session(planner, sampling, sizes=sizes, latent_shape=_latent_shape(noise), device=noise.device,
                           latents=noise, continue_cache=continue_cache)
    made = list(tqdm(session, total=len(sizes), desc="causal rollout", unit="chunk", disable=not progress))
    return RolloutOutput(latents=torch.cat([m.latents for m in made], dim=2), chunk_sizes=sizes,
                         chunk_seconds=[m.seconds for m in made])


def self_forcing_rollout(
    model,
    noise: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    exit_step: int | Sequence[int] | None = None,
    grad_from_frame: int = 0,
    chunk_frames: int | Sequence[int] = DEFAULTS.chunk_frames,
    timesteps: Sequence[float] = DEFAULTS.timesteps,
    shift: float = DEFAULTS.shift,
    context_noise: float = 0.0,
    context_noise_mode: str = "renoise",
    negative_prompt_embeds: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    condition_latents: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,  # Wan2.1 I2V
    control_latents: torch.Tensor | None = None, control_scale: torch.Tensor | None = None,  # VACE
    cache_engines: dict | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    context_latents: torch.Tensor | None = None,
) -> RolloutOutput:
    """The Self-Forcing training rollout: few-step causal generation in which each chunk keeps gradients for one
    denoising step only, ready for a DMD-style loss on ``latents``.

    For each chunk the steps before its exit step run without gradients (predict x0, re-noise to the next
    timestep); the exit step runs with gradients and its x0 prediction is the chunk's output; then the clean chunk is
    committed without gradients. The chunk's self-attention reads the cached prefix detached (the engine never
    holds autograd state) and recomputes its own and the conditioning's K/V with gradients. Gradient checkpointing
    (``transformer.enable_gradient_checkpointing()``) gives the same gradients: its recomputation in ``backward()``
    sees the prefix the forward saw, even though later chunks were committed in between.

    Arguments not listed below are as in :func:`causal_rollout` (few-step sampling only).

    Args:
        exit_step: index into ``timesteps`` of the step that keeps gradients: one int for every chunk, one per chunk,
            or ``None`` to draw one uniformly with ``generator`` for the whole rollout (Self-Forcing's default).
        grad_from_frame: chunks that start before this latent frame keep no gradients at all (Self-Forcing trains
            on the last frames of a long rollout only).
        context_noise_mode: ``"renoise"`` by default here, as Self-Forcing's training re-noises the clean chunk to
            ``context_noise`` before committing it; ``"label"`` commits it clean with that timestep label.
        context_latents: clean latents ``[batch, channels, frames, height, width]`` of a real clip's first frames,
            committed (without gradients) before the rollout, so that the generated chunks continue them: the
            rollout then starts at frame ``context_latents.shape[2]`` and a loss can compare its chunks with the
            clip's own continuation (text-conditioned models; ``chunk_frames`` plans the context and the generated
            frames together, and the context must end on a chunk boundary).

    Returns:
        :class:`RolloutOutput` whose ``latents`` (the generated frames only) carry the autograd graph and whose
        ``exit_steps`` give each chunk's exit step (the DMD loss needs the timestep it exited at).
    """
    planner = RolloutPlanner(model, prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                             guidance_scale=guidance_scale, image_embeds=image_embeds,
                             condition_latents=condition_latents, control_latents=control_latents,
                             control_scale=control_scale, cache_engines=cache_engines, generator=generator)
    context_sizes, sizes = _context_plan(planner, noise, context_latents, chunk_frames)
    exits = _exit_steps(exit_step, len(timesteps), len(sizes), generator)
    sampling = Sampling.create(timesteps, shift, context_noise, context_noise_mode)
    sigmas = sampling.sigmas
    session = RolloutSession(planner, sampling, sizes=context_sizes + sizes, latent_shape=_latent_shape(noise),
                             device=noise.device)  # checks the whole plan, then clears
    if context_sizes:
        session.prefill(context_latents, context_sizes)
    chunks = planner.plan(noise, sizes, session.next_frame)  # the session's gradient loop is this one
    outputs, seconds = [], []
    for chunk, exit_at in zip(tqdm(chunks, desc="self-forcing rollout", unit="chunk", disable=not progress), exits):
        began = time.perf_counter()
        x = noise[:, :, chunk.offset:chunk.offset + chunk.size]
        with torch.no_grad():
            for i in range(exit_at):
                x = planner.renoise(planner.predict_x0(x, sigmas[i], chunk), sigmas[i + 1])
        with torch.set_grad_enabled(torch.is_grad_enabled() and chunk.offset >= grad_from_frame):
            x0 = planner.predict_x0(x, sigmas[exit_at], chunk)
        planner.commit(x0.detach(), chunk, context_noise, context_noise_mode)
        seconds.append(time.perf_counter() - began)
        outputs.append(x0)
    return RolloutOutput(latents=torch.cat(outputs, dim=2), chunk_sizes=[c.size for c in chunks],
                         chunk_seconds=seconds, exit_steps=exits)


def _context_plan(planner: RolloutPlanner, noise: torch.Tensor, context: torch.Tensor | None,
                  chunk_frames: int | Sequence[int]) -> tuple[list[int], list[int]]:
    """The chunk sizes of the clean context and of the generated frames (one plan over both)."""
    if context is None:
        return [], chunk_schedule(noise.shape[2], chunk_frames)
    if any(v is not None for v in planner.per_frame.values()):
        raise ValueError("context_latents works with text-conditioned models only: the I2V/VACE per-frame inputs "
                         "cover the generated frames. Commit the context with prefill() and roll out with "
                         "causal_rollout(..., continue_cache=True), or drop context_latents.")
    if context.shape[:2] != noise.shape[:2] or context.shape[3:] != noise.shape[3:]:
        raise ValueError(f"context_latents {tuple(context.shape)} must match noise {tuple(noise.shape)} in every "
                         "dimension but frames (dim 2).")
    sizes = chunk_schedule(context.shape[2] + noise.shape[2], chunk_frames)
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    if context.shape[2] not in ends:
        raise ValueError(f"context_latents has {context.shape[2]} frames, which do not end on a chunk boundary of "
                         f"the plan {sizes} (context and generated frames together); pass a context of one of "
                         f"{ends[:-1]} frames or other chunk_frames.")
    split = ends.index(context.shape[2]) + 1
    return sizes[:split], sizes[split:]


def _exit_steps(exit_step, num_steps: int, num_chunks: int, generator) -> list[int]:
    if exit_step is None:
        device = generator.device if generator is not None else "cpu"
        return [int(torch.randint(num_steps, (1,), generator=generator, device=device))] * num_chunks
    exits = [exit_step] * num_chunks if isinstance(exit_step, int) else list(exit_step)
    if len(exits) != num_chunks or any(not isinstance(e, int) or not 0 <= e < num_steps for e in exits):
        raise ValueError(
            f"exit_step must be an index into the {num_steps} timesteps (0..{num_steps - 1}), one int or one per "
            f"chunk ({num_chunks} chunks), got {exit_step!r}."
        )
    return exits


def _latent_shape(latents: torch.Tensor) -> tuple[int, int, int, int]:
    """``(batch, channels, height, width)`` of ``[batch, channels, frames, height, width]`` latents."""
    return (*latents.shape[:2], *latents.shape[3:])
