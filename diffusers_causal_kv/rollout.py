"""The causal sampling loop (Self-Forcing / CausVid inference) as a function.

For each chunk of latent frames: denoise it against the cached prefix (few-step sampling over a timestep list, or
any diffusers flow-matching scheduler, reset for every chunk), then run one commit pass on the clean chunk
(``store_kv=True``, at t=0 or at a ``context_noise`` level) so the next chunks attend to it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .context import CausalContext
from .masks import chunk_schedule
from .model import clear_caches


@dataclass
class RolloutOutput:
    """Result of :func:`causal_rollout`."""

    latents: torch.Tensor
    """Clean latents ``[batch, channels, frames, height, width]``."""
    chunk_sizes: list[int]
    """Latent frames per chunk, in order."""
    chunk_seconds: list[float] = field(default_factory=list)
    """Wall-clock seconds per chunk (denoising and commit)."""


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
    """
    transformer = resolve_transformer(model)
    batch, _, num_frames = noise.shape[:3]
    sizes = chunk_schedule(num_frames, chunk_frames)
    if scheduler is not None and not num_inference_steps:
        raise ValueError("scheduler sampling needs num_inference_steps (the steps per chunk).")
    for name, latents in (("condition_latents", condition_latents), ("control_latents", control_latents)):
        if latents is not None and latents.shape[2] != num_frames:
            raise ValueError(f"{name} has {latents.shape[2]} frames but noise has {num_frames}; they must match.")
    is_vace = getattr(transformer, "vace_blocks", None) is not None
    if is_vace != (control_latents is not None):
        raise ValueError(
            "a VACE transformer needs control_latents (the control video's latents for every frame)" if is_vace
            else "control_latents were given but the transformer has no VACE blocks; drop them."
        )
    use_cfg = guidance_scale != 1.0
    if use_cfg and negative_prompt_embeds is None:
        raise ValueError("guidance_scale != 1 needs negative_prompt_embeds (the 'neg' cache tag's conditioning).")
    prompts = {"pos": prompt_embeds, **({"neg": negative_prompt_embeds} if use_cfg else {})}
    if cache_engines is not None:
        for engine in cache_engines.values():
            engine.clear()
    else:
        clear_caches(transformer)

    def forward(x, t, start, tag, store_kv, cond):
        """One transformer forward on a chunk; ``cond`` holds the chunk's slices of the per-frame inputs."""
        inputs = x if cond["condition"] is None else torch.cat([x, cond["condition"]], dim=1)
        extra = {} if cond["control"] is None else {
            "control_hidden_states": cond["control"], "control_hidden_states_scale": control_scale
        }
        timestep = torch.full((batch,), float(t), device=x.device, dtype=torch.float32)
        with CausalContext(transformer, start_frame=start, cache_tag=tag, store_kv=store_kv,
                           cache_engines=cache_engines):
            return transformer(hidden_states=inputs, timestep=timestep, encoder_hidden_states=prompts[tag],
                               encoder_hidden_states_image=image_embeds, return_dict=False, **extra)[0]

    def flow(x, t, start, cond):
        pos = forward(x, t, start, "pos", False, cond)
        if not use_cfg:
            return pos
        neg = forward(x, t, start, "neg", False, cond)
        return neg + guidance_scale * (pos - neg)

    def randn_like(x):
        return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)

    sigmas = shifted_sigmas(timesteps, shift) if scheduler is None else None
    outputs, seconds, start = [], [], 0
    for size in tqdm(sizes, desc="causal rollout", unit="chunk", disable=not progress):
        began = time.perf_counter()
        x = noise[:, :, start:start + size]
        cond = {
            name: None if latents is None else latents[:, :, start:start + size]
            for name, latents in (("condition", condition_latents), ("control", control_latents))
        }
        if scheduler is None:
            for i, sigma in enumerate(sigmas.tolist()):
                x0 = x - sigma * flow(x, sigma * 1000, start, cond)
                if i + 1 < len(sigmas):
                    x = (1 - sigmas[i + 1].item()) * x0 + sigmas[i + 1].item() * randn_like(x0)
            x = x0
        else:
            scheduler.set_timesteps(num_inference_steps, device=x.device)
            for t in scheduler.timesteps:
                x = scheduler.step(flow(x, t, start, cond), t, x, return_dict=False)[0]
        committed = x
        if context_noise > 0:
            level = context_noise / 1000
            committed = (1 - level) * x + level * randn_like(x)
        for tag in prompts:
            forward(committed, context_noise, start, tag, True, cond)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        seconds.append(time.perf_counter() - began)
        outputs.append(x)
        start += size
    return RolloutOutput(latents=torch.cat(outputs, dim=2), chunk_sizes=sizes, chunk_seconds=seconds)
