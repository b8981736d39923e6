"""The causal sampling loops as functions: inference (Self-Forcing / CausVid) and the self-forcing training rollout.

For each chunk of latent frames: denoise it against the cached prefix (few-step sampling over a timestep list, or
any diffusers flow-matching scheduler, reset for every chunk), then run one commit pass on the clean chunk
(``store_kv=True``, at t=0 or at a ``context_noise`` level) so the next chunks attend to it.

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

from .context import CausalContext, commits_together
from .masks import chunk_schedule
from .model import check_forward_inputs, clear_caches


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


def shifted_sigmas(timesteps: Sequence[float], shift: float = 1.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Flow-matching noise levels of a few-step timestep list, warped by the timestep ``shift`` as Self-Forcing does
    (``sigma = shift * s / (1 + (shift - 1) * s)`` with ``s = t / num_train_timesteps``)."""
    s = torch.as_tensor(timesteps, dtype=torch.float64) / num_train_timesteps
    if (s <= 0).any() or (s > 1).any():
        raise ValueError(f"timesteps must lie in (0, {num_train_timesteps}], got {list(timesteps)}.")
    return (shift * s / (1 + (shift - 1) * s)).float()


def resolve_transformer(model) -> torch.nn.Module:
    """The transformer of a pipeline, or ``model`` itself; refuses two-expert (Wan2.2 A14B) pipelines."""
    if getattr(model, "transformer_2", None) is not None:
        raise NotImplementedError(
            "two-expert Wan2.2 pipelines (transformer + transformer_2 switched at a boundary timestep) are not "
            "supported by the causal rollout yet; pass a single-expert pipeline or one transformer."
        )
    return getattr(model, "transformer", model)


class _ChunkForwards:
    """The transformer forwards of one rollout: per-frame inputs sliced per chunk, one context per forward, CFG."""

    first_frame = 0  # absolute frame index of the rollout's first frame (> 0 when it continues a cache)

    def __init__(self, model, noise, prompt_embeds, negative_prompt_embeds, guidance_scale, chunk_frames,
                 condition_latents, image_embeds, control_latents, control_scale, cache_engines, generator):
        self.transformer = transformer = resolve_transformer(model)
        self.batch, _, num_frames = noise.shape[:3]
        self.sizes = chunk_schedule(num_frames, chunk_frames)
        for name, latents in (("condition_latents", condition_latents), ("control_latents", control_latents)):
            if latents is not None and latents.shape[2] != num_frames:
                raise ValueError(f"{name} has {latents.shape[2]} frames but noise has {num_frames}; they must match.")
        is_vace = getattr(transformer, "vace_blocks", None) is not None
        if is_vace != (control_latents is not None):
            raise ValueError(
                "a VACE transformer needs control_latents (the control video's latents for every frame)" if is_vace
                else "control_latents were given but the transformer has no VACE blocks; drop them."
            )
        self.use_cfg = guidance_scale != 1.0
        if self.use_cfg and negative_prompt_embeds is None:
            raise ValueError("guidance_scale != 1 needs negative_prompt_embeds (the 'neg' cache tag's conditioning).")
        self.prompts = {"pos": prompt_embeds, **({"neg": negative_prompt_embeds} if self.use_cfg else {})}
        self.guidance_scale, self.image_embeds = guidance_scale, image_embeds
        self.per_frame = {"condition": condition_latents, "control": control_latents}
        self.control_scale, self.cache_engines, self.generator = control_scale, cache_engines, generator

    def clear(self) -> None:
        if self.cache_engines is None:
            clear_caches(self.transformer)
        else:
            for engine in self.cache_engines.values():
                engine.clear()

    def chunk_inputs(self, start: int, size: int) -> dict:
        """The chunk's slices of the per-frame inputs (I2V condition, VACE control)."""
        return {name: None if v is None else v[:, :, start:start + size] for name, v in self.per_frame.items()}

    def inputs(self, x, t, tag, cond) -> dict:
        """The transformer's keyword arguments for a chunk ``x`` at timestep ``t`` on ``tag``."""
        inputs = {
            "hidden_states": x if cond["condition"] is None else torch.cat([x, cond["condition"]], dim=1),
            "timestep": torch.full((self.batch,), float(t), device=x.device, dtype=torch.float32),
            "encoder_hidden_states": self.prompts[tag],
            "encoder_hidden_states_image": self.image_embeds,
        }
        if cond["control"] is not None:
            inputs.update(control_hidden_states=cond["control"], control_hidden_states_scale=self.control_scale)
        return inputs

    def forward(self, x, t, start, tag, store_kv, cond):
        """One transformer forward on a chunk under its :class:`CausalContext`."""
        with CausalContext(self.transformer, start_frame=self.first_frame + start, cache_tag=tag, store_kv=store_kv,
                           cache_engines=self.cache_engines):
            return self.transformer(**self.inputs(x, t, tag, cond), return_dict=False)[0]

    def flow(self, x, t, start, cond):
        """The (guided) flow prediction for a chunk at timestep ``t``."""
        pos = self.forward(x, t, start, "pos", False, cond)
        if not self.use_cfg:
            return pos
        neg = self.forward(x, t, start, "neg", False, cond)
        return neg + self.guidance_scale * (pos - neg)

    def predict_x0(self, x, sigma: float, start, cond):
        """The clean chunk the (guided) flow predicts from ``x`` at noise level ``sigma``."""
        return x - sigma * self.flow(x, sigma * 1000, start, cond)

    def renoise(self, x0, sigma: float):
        """``x0`` noised to level ``sigma`` with fresh noise (the flow-matching forward process)."""
        return (1 - sigma) * x0 + sigma * self.randn_like(x0)

    def check(self, noise) -> None:
        """Fail before any work (a fresh rollout: before clearing the caches) if the rollout cannot run: inputs the
        model refuses (checked on the first chunk of every tag), a chunk schedule an engine cannot hold, or frames
        past the RoPE table."""
        cond = self.chunk_inputs(0, self.sizes[0])
        for tag in self.prompts:
            check_forward_inputs(self.transformer, self.inputs(noise[:, :, :self.sizes[0]], 0.0, tag, cond))
        engines = self.cache_engines or getattr(self.transformer, "kv_cache_engines", None) or {}
        for engine in engines.values():
            engine.check_schedule(self.first_frame, self.sizes)
        if len({e.reindexes_positions for e in engines.values()}) > 1:  # a forward finds it only at an eviction
            raise ValueError(
                "the engines of this transformer place the chunk at different RoPE positions (relative and absolute "
                "ones), but one rotary embedding serves every branch; give every branch the same kind of engine and "
                "positions."
            )
        if any(e.reindexes_positions for e in engines.values()):  # not bounded by the RoPE table
            return
        end, max_len = self.first_frame + sum(self.sizes), self.transformer.rope.max_seq_len
        if end > max_len:
            raise ValueError(
                f"the rollout covers latent frames {self.first_frame}..{end - 1} but the RoPE table has {max_len} "
                "positions (rope_max_seq_len); generate fewer frames, use a model with a larger rope_max_seq_len, "
                "or a RollingKVCacheEngine(..., positions='relative'), which re-indexes positions."
            )

    def commit(self, x, context_noise, start, cond) -> None:
        """Commit a clean chunk on every tag, re-noised to ``context_noise`` (timestep units) when above 0."""
        if context_noise > 0:
            x = self.renoise(x, context_noise / 1000)
        with torch.no_grad(), commits_together():  # every tag or none, so the tags never disagree
            for tag in self.prompts:
                self.forward(x, context_noise, start, tag, True, cond)

    def randn_like(self, x):
        return torch.randn(x.shape, generator=self.generator, device=x.device, dtype=x.dtype)


@torch.no_grad()
def causal_rollout(
    model,
    noise: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    negative_prompt_embeds: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    chunk_frames: int | Sequence[int] = 3,
    timesteps: Sequence[float] = (1000, 750, 500, 250),
    shift: float = 5.0,
    scheduler=None,
    num_inference_steps: int | None = None,
    context_noise: float = 0.0,
    condition_latents: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    control_latents: torch.Tensor | None = None,
    control_scale: torch.Tensor | None = None,
    cache_engines: dict | None = None,
    generator: torch.Generator | None = None,
    progress: bool = True,
    continue_cache: bool = False,
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
        context_noise: noise level (in timestep units, 0..1000) at which clean chunks are committed.
        condition_latents: Wan2.1 I2V condition (mask and image latents), ``[batch, 20, frames, height, width]``,
            concatenated to each chunk's latents along channels.
        image_embeds: Wan2.1 I2V image-encoder embeddings, passed to every forward.
        control_latents / control_scale: VACE control latents ``[batch, vace_in_channels, frames, height, width]``,
            sliced per chunk like the noise, and the per-VACE-layer scale (``[len(vace_layers)]``, default ones).
        cache_engines: engine map for this rollout (one per user session); default ``transformer.kv_cache_engines``.
        generator: random generator for re-noising.
        progress: show a tqdm progress bar over chunks.
        continue_cache: keep the cache instead of clearing it, and start at the frame the ``"main"`` engine's
            ``"pos"`` tag continues at (after :func:`~diffusers_causal_kv.streaming.prefill`, a re-cache or an
            earlier rollout); the per-frame inputs still cover the generated frames only.
    """
    run = _ChunkForwards(model, noise, prompt_embeds, negative_prompt_embeds, guidance_scale, chunk_frames,
                         condition_latents, image_embeds, control_latents, control_scale, cache_engines, generator)
    if scheduler is not None and not num_inference_steps:
        raise ValueError("scheduler sampling needs num_inference_steps (the steps per chunk).")
    sigmas = shifted_sigmas(timesteps, shift).tolist() if scheduler is None else None  # validated before the clear
    if continue_cache:
        engines = run.cache_engines or getattr(run.transformer, "kv_cache_engines", None) or {}
        run.first_frame = engines["main"].next_frame("pos") if "main" in engines else 0
    run.check(noise)
    if not continue_cache:
        run.clear()
    outputs, seconds, start = [], [], 0
    for size in tqdm(run.sizes, desc="causal rollout", unit="chunk", disable=not progress):
        began = time.perf_counter()
        x, cond = noise[:, :, start:start + size], run.chunk_inputs(start, size)
        if scheduler is None:
            for i, sigma in enumerate(sigmas):
                x0 = run.predict_x0(x, sigma, start, cond)
                if i + 1 < len(sigmas):
                    x = run.renoise(x0, sigmas[i + 1])
            x = x0
        else:
            scheduler.set_timesteps(num_inference_steps, device=x.device)
            for t in scheduler.timesteps:
                x = scheduler.step(run.flow(x, t, start, cond), t, x, return_dict=False)[0]
        run.commit(x, context_noise, start, cond)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        seconds.append(time.perf_counter() - began)
        outputs.append(x)
        start += size
    return RolloutOutput(latents=torch.cat(outputs, dim=2), chunk_sizes=run.sizes, chunk_seconds=seconds)


def self_forcing_rollout(
    model,
    noise: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    exit_step: int | Sequence[int] | None = None,
    grad_from_frame: int = 0,
    chunk_frames: int | Sequence[int] = 3,
    timesteps: Sequence[float] = (1000, 750, 500, 250),
    shift: float = 5.0,
    context_noise: float = 0.0,
    negative_prompt_embeds: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    condition_latents: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    control_latents: torch.Tensor | None = None,
    control_scale: torch.Tensor | None = None,
    cache_engines: dict | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> RolloutOutput:
    """The Self-Forcing training rollout: few-step causal generation in which each chunk keeps gradients for one
    denoising step only, ready for a DMD-style loss on ``latents``.

    For each chunk the steps before its exit step run without gradients (predict x0, re-noise to the next
    timestep); the exit step runs with gradients and its x0 prediction is the chunk's output; then the clean chunk is
    committed without gradients. The chunk's self-attention reads the cached prefix detached (the engine never
    holds autograd state) and recomputes its own and the conditioning's K/V with gradients. Gradient checkpointing
    (``transformer.enable_gradient_checkpointing()``) gives the same gradients: its recomputation in ``backward()``
    sees the prefix the forward saw, even though later chunks were committed in between.

    Args:
        exit_step: index into ``timesteps`` of the step that keeps gradients: one int for every chunk, one per chunk,
            or ``None`` to draw one uniformly with ``generator`` for the whole rollout (Self-Forcing's default).
        grad_from_frame: chunks that start before this latent frame keep no gradients at all (Self-Forcing trains
            on the last frames of a long rollout only).
        Other arguments as in :func:`causal_rollout` (few-step sampling only).

    Returns:
        :class:`RolloutOutput` whose ``latents`` carry the autograd graph and whose ``exit_steps`` give each chunk's
        exit step (the DMD loss needs the timestep it exited at).
    """
    run = _ChunkForwards(model, noise, prompt_embeds, negative_prompt_embeds, guidance_scale, chunk_frames,
                         condition_latents, image_embeds, control_latents, control_scale, cache_engines, generator)
    exits = _exit_steps(exit_step, len(timesteps), len(run.sizes), generator)
    sigmas = shifted_sigmas(timesteps, shift).tolist()
    run.check(noise)
    run.clear()
    outputs, seconds, start = [], [], 0
    for size, exit_at in zip(tqdm(run.sizes, desc="self-forcing rollout", unit="chunk", disable=not progress),
                             exits):
        began = time.perf_counter()
        x, cond = noise[:, :, start:start + size], run.chunk_inputs(start, size)
        with torch.no_grad():
            for i in range(exit_at):
                x = run.renoise(run.predict_x0(x, sigmas[i], start, cond), sigmas[i + 1])
        with torch.set_grad_enabled(torch.is_grad_enabled() and start >= grad_from_frame):
            x0 = run.predict_x0(x, sigmas[exit_at], start, cond)
        run.commit(x0.detach(), context_noise, start, cond)
        seconds.append(time.perf_counter() - began)
        outputs.append(x0)
        start += size
    return RolloutOutput(latents=torch.cat(outputs, dim=2), chunk_sizes=run.sizes, chunk_seconds=seconds,
                         exit_steps=exits)


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
