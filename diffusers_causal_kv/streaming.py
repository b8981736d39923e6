"""Open-ended rollouts: :class:`StreamingRollout` generates chunks on demand over a
:class:`~diffusers_causal_kv.session.RolloutSession`, prefills from a clip and switches prompts.

For bounded memory put a :class:`~diffusers_causal_kv.RollingKVCacheEngine` on the transformer (or pass
``cache_engines``): the session keeps the clean latents of the frames the cache holds (bounded like the cache) and
re-caches them when the prompt changes (:mod:`~diffusers_causal_kv.refill`).

Failures: :meth:`StreamingRollout.switch_prompt` builds the new tags in scratch engines and swaps them in at the end,
so an error leaves the old tags as they were. :meth:`StreamingRollout.prefill` and :meth:`StreamingRollout.generate`
commit chunk by chunk, each chunk atomically: an error leaves the chunks before it committed (``next_frame`` says
where to continue).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .causal_config import DEFAULTS
from .kv_cache import BaseKVCacheEngine
from .planner import RolloutPlanner
from .rollout import RolloutOutput
from .session import RolloutSession, Sampling


class StreamingRollout:
    """An open-ended causal rollout: generate chunks on demand, prefill from a clip, switch prompts.

    Put a :class:`~diffusers_causal_kv.RollingKVCacheEngine` on ``transformer.kv_cache_engines`` (or pass
    ``cache_engines``) for bounded memory; the rollout keeps the clean latents of the frames the cache holds, so a
    :meth:`switch_prompt` can re-cache them. Wan2.1 I2V and VACE streams pass their per-frame inputs
    (``condition_latents``, ``control_latents``) with each :meth:`generate` and :meth:`prefill` call, covering the
    frames of that call; their prompt switches swap the cross-attention entries only (``mode="cross"``).

    Args:
        model: a Wan transformer with ``CausalWanAttnProcessor`` installed, or a pipeline holding one.
        prompt_embeds / negative_prompt_embeds / guidance_scale: the conditioning, with CFG through tags
            ``"pos"``/``"neg"`` when ``guidance_scale != 1``.
        chunk_frames, timesteps, shift, context_noise, context_noise_mode, generator: as in
            :func:`~diffusers_causal_kv.causal_rollout`.
        cache_engines: engine map of this rollout; default ``transformer.kv_cache_engines``.
        image_embeds / control_scale / attention_kwargs: Wan2.1 I2V image embeddings, the VACE layers' scale and
            the forwards' ``attention_kwargs``, for every chunk.
        cfg_batch: with guidance, the two tags' passes of a chunk as one batched forward (default) or two.
        **experts: Wan2.2 settings passed to :class:`~diffusers_causal_kv.RolloutPlanner` (``guidance_scale_2``,
            ``boundary_ratio``, ``expand_timesteps``, ``first_frame_latents``).

    The caches are cleared when the rollout is created.
    """

    def __init__(
        self,
        model,
        prompt_embeds: torch.Tensor,
        *,
        negative_prompt_embeds: torch.Tensor | None = None,
        guidance_scale: float = 1.0,
        chunk_frames: int = DEFAULTS.chunk_frames,
        timesteps: Sequence[float] = DEFAULTS.timesteps,
        shift: float = DEFAULTS.shift,
        context_noise: float = 0.0,
        context_noise_mode: str = "label",
        cache_engines: dict | None = None,
        generator: torch.Generator | None = None,
        image_embeds: torch.Tensor | None = None,
        control_scale: torch.Tensor | None = None,
        attention_kwargs: dict | None = None,
        cfg_batch: bool = True,
        **experts,
    ) -> None:
        planner = RolloutPlanner(model, prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                                 guidance_scale=guidance_scale, cache_engines=cache_engines, generator=generator,
                                 image_embeds=image_embeds, control_scale=control_scale,
                                 attention_kwargs=attention_kwargs, cfg_batch=cfg_batch, **experts)
        self.chunk_frames = chunk_frames
        sampling = Sampling.create(timesteps, shift, context_noise, context_noise_mode)
        # Chunks come with generate(); re-caching commits at most a chunk's frames per pass.
        most = chunk_frames if isinstance(chunk_frames, int) else max(chunk_frames)
        self.session = RolloutSession(planner, sampling, sizes=iter(()), keep_window=True, recache_frames=most)
        self.transformer = planner.transformer

    @property
    def prompts(self):
        """The conditioning of each tag (read-only; :meth:`switch_prompt` changes it)."""
        return self.session.prompts

    @property
    def per_frame_inputs(self) -> bool:
        """Whether chunks take per-frame inputs (Wan2.1 I2V, I2V-A14B, VACE)."""
        return not self.session.text_only

    @property
    def engine(self) -> BaseKVCacheEngine | None:
        """The engine of the ``"main"`` branch (``None`` before the first forward created it)."""
        return self.session.engine_maps()[0].get("main")

    @property
    def next_frame(self) -> int:
        """The absolute latent frame the next chunk starts at."""
        return self.session.next_frame

    def window(self) -> list[tuple[int, torch.Tensor]]:
        """``(start_frame, clean latents)`` of each range of frames the cache holds (sink, then recent frames)."""
        return self.session.window()

    def memory_bytes(self) -> int:
        """Bytes held by the engines and by the clean latents kept for re-caching."""
        return self.session.memory_bytes()

    @torch.no_grad()
    def prefill(self, latents: torch.Tensor, *, condition_latents: torch.Tensor | None = None,
                control_latents: torch.Tensor | None = None) -> None:
        """Continue the rollout with the given clean latents (e.g. the end of a real clip) instead of generating;
        ``condition_latents`` / ``control_latents``: the I2V / VACE inputs of the same frames."""
        self.session.prefill(latents, self.chunk_frames, condition_latents=condition_latents,
                             control_latents=control_latents)

    @torch.no_grad()
    def generate(self, noise: torch.Tensor, progress: bool = False, *, condition_latents: torch.Tensor | None = None,
                 control_latents: torch.Tensor | None = None, chunk_frames: int | Sequence[int] | None = None,
                 on_step=None) -> RolloutOutput:
        """Denoise ``noise.shape[2]`` more latent frames, chunk by chunk, continuing the cache.

        ``condition_latents`` / ``control_latents``: the I2V / VACE inputs of the same frames. ``chunk_frames``:
        this call's chunk schedule (default: the rollout's). ``on_step(chunk, step, t, latents)``: as in
        :func:`~diffusers_causal_kv.session.denoise_chunk`, with the chunk first. Each committed chunk is kept at
        once, so an interrupted call leaves the rollout consistent with its cache (the chunks before it kept)."""
        session = self.session
        given = {"condition_latents": condition_latents, "control_latents": control_latents}
        planner = session.planner.with_frames(**given)
        chunks = planner.plan(noise, self.chunk_frames if chunk_frames is None else chunk_frames, self.next_frame)
        planner.check(noise, chunks)  # the whole request, as one causal_rollout call would
        first = chunks[0].frame

        def chunk_inputs(start: int, size: int) -> dict:
            offset = start - first
            part = {k: v[:, :, offset:offset + size] for k, v in given.items() if v is not None}
            return {**part, "noise": noise[:, :, offset:offset + size]}

        session.replan([c.size for c in chunks], chunk_inputs)
        made = [session.step(on_step)
                for _ in tqdm(chunks, desc="streaming rollout", unit="chunk", disable=not progress)]
        return RolloutOutput(latents=torch.cat([m.latents for m in made], dim=2), chunk_sizes=[c.size for c in chunks],
                             chunk_seconds=[m.seconds for m in made])

    def switch_prompt(self, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None = None,
                      mode: str = "recache") -> None:
        """Use new conditioning from the next chunk on: the ``"pos"`` tag, and the ``"neg"`` tag too when CFG runs
        and a new negative prompt is given (the negative prompt is kept otherwise).

        ``mode="recache"`` (LongLive) re-caches the window under the new prompt (:mod:`~diffusers_causal_kv.refill`),
        so the next chunks attend to frames whose K/V were computed under it; ``mode="cross"`` only swaps the
        cross-attention entries: the cached frames keep the K/V of the old prompt (no forward at all)."""
        self.session.switch_prompt(prompt_embeds, negative_prompt_embeds, mode=mode)
