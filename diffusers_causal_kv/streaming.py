"""Long and streaming rollouts: prefill the cache from clean latents, and re-cache the window on a prompt switch.

* :func:`prefill` commits given clean latents chunk by chunk (commit passes only, no denoising), so a rollout can
  continue a real clip.
* :func:`recache` switches a tag to new conditioning, as LongLive does on a prompt switch: it resets the tag's
  cross-attention entries and recomputes the self K/V of the frames still in the window under the new prompt
  (the sink frames first, then the recent ones at their own frame indices), from their clean latents.
* :class:`StreamingRollout` ties them to :func:`~diffusers_causal_kv.causal_rollout` for an open-ended rollout on a
  :class:`~diffusers_causal_kv.RollingKVCacheEngine`: it generates chunks as they are asked for, keeps the clean
  latents of the frames the cache holds (bounded like the cache) and re-caches them when the prompt changes.

Failures: :func:`recache` and :meth:`StreamingRollout.switch_prompt` build the new tags in scratch engines and swap
them in at the end, so an error leaves the old tags as they were. :func:`prefill` and
:meth:`StreamingRollout.generate` commit chunk by chunk, each chunk atomically: an error leaves the chunks before it
committed (``next_frame`` says where to continue), and undoes a :func:`prefill` skip that no chunk followed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .kv_cache import BaseKVCacheEngine, RollingKVCacheEngine
from .masks import chunk_schedule
from .model import experts_of, resolve_engines, topology
from .planner import RolloutPlanner, check_context_noise, expert_engine_maps, resolve_transformer
from .rollout import RolloutOutput, rollout_chunks, shifted_sigmas


@torch.no_grad()
def prefill(
    model,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    cache_tag: str = "pos",
    start_frame: int | None = None,
    chunk_frames: int | Sequence[int] = 3,
    context_noise: float = 0.0,
    context_noise_mode: str = "label",
    image_embeds: torch.Tensor | None = None,
    condition_latents: torch.Tensor | None = None,
    control_latents: torch.Tensor | None = None,
    control_scale: torch.Tensor | None = None,
    cache_engines: dict | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """Commit clean ``latents`` (``[batch, channels, frames, height, width]``) to ``cache_tag``, chunk by chunk.

    Args:
        start_frame: absolute frame index of the first latent frame. ``None`` continues the tag where it is; a
            later frame skips the frames in between (:meth:`RollingKVCacheEngine.skip_to`; rolling engines only).
        chunk_frames: chunk size of the commit passes (remainder absorbed by the first chunk) or a list of sizes.
        context_noise / context_noise_mode: the commit passes' timestep label, and whether the frames are first
            noised to it (``"renoise"``) or committed clean (``"label"``), as in ``causal_rollout``.
        image_embeds / condition_latents / control_latents / control_scale: the per-forward and per-frame inputs of
            Wan2.1 I2V and VACE (the per-frame ones cover the same frames as ``latents``).
        cache_engines: engine map to write; default ``transformer.kv_cache_engines``.

    Returns:
        The tag's next frame (the ``start_frame`` of the chunk that continues the clip).
    """
    planner = RolloutPlanner(model, prompt_embeds, cache_tag=cache_tag, image_embeds=image_embeds,
                             condition_latents=condition_latents, control_latents=control_latents,
                             control_scale=control_scale, cache_engines=cache_engines, generator=generator)
    cached = planner.next_frame()
    # every expert's engines (Wan2.2 A14B has two maps), so that a skip moves both experts' caches
    engines = [e for _, m in expert_engines(model, cache_engines) for e in m.values()]
    start = cached if start_frame is None else start_frame
    chunks = planner.plan(latents, chunk_frames, start, given="latents")  # every check before a skip changes the cache
    check_context_noise(context_noise, context_noise_mode)
    if start != cached:
        can_skip = bool(engines) and all(isinstance(e, RollingKVCacheEngine) for e in engines)
        if start < cached or not can_skip:
            raise ValueError(
                f"prefill(start_frame={start}) on cache tag {cache_tag!r}, which continues at frame {cached}: pass "
                f"start_frame={cached} (or None), crop the cache first, or skip forward on a RollingKVCacheEngine."
            )
    with contextlib.ExitStack() as skips:
        if start != cached:
            for engine in engines:
                skips.enter_context(engine.skipping_to(start, cache_tag))
        for chunk in chunks:
            planner.commit(latents[:, :, chunk.offset:chunk.offset + chunk.size], chunk, context_noise,
                           context_noise_mode)
    return start + latents.shape[2]


@torch.no_grad()
def recache(
    model,
    window: Sequence[tuple[int, torch.Tensor]],
    prompt_embeds: torch.Tensor,
    *,
    cache_tag: str = "pos",
    chunk_frames: int = 3,
    context_noise: float = 0.0,
    context_noise_mode: str = "label",
    image_embeds: torch.Tensor | None = None,
    cache_engines: dict | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Re-cache ``cache_tag`` under new conditioning: prefill the frames the tag still holds, from their clean
    latents, with ``prompt_embeds``, into a fresh tag (its cross entries included) that replaces the old one. The tag
    then continues at the frame it continued at before. The new tag is built in scratch engines and handed over only
    once every forward succeeded, so an error leaves the old tag as it was (at the cost of holding the tag twice
    meanwhile).

    Args:
        window: ``(start_frame, clean latents)`` for each range of :meth:`RollingKVCacheEngine.held_frames`
            (the sink frames, then the recent ones), as :meth:`StreamingRollout.window` gives them.
        chunk_frames: the most frames per commit pass; each range is split into such chunks with the remainder
            as a chunk of its own at the start (:func:`recache_schedule`), so every chunk fits the window.
        Other arguments as in :func:`prefill`.
    """
    experts = expert_engines(model, cache_engines)
    # Every expert is re-cached (with its own weights) before any is swapped in.
    scratch = [_recached(transformer, engines, window, prompt_embeds, cache_tag, chunk_frames,
                         (context_noise, context_noise_mode), image_embeds, generator)
               for transformer, engines in experts]
    for (_, engines), built in zip(experts, scratch):
        for branch, engine in engines.items():
            engine.adopt_tag(built[branch], cache_tag)


def expert_engines(model, cache_engines: dict | None = None) -> list[tuple[torch.nn.Module, dict]]:
    """``(transformer, engine map)`` of every expert of ``model`` (one, or the two of Wan2.2 A14B)."""
    transformers = experts_of(model)
    return [(t, resolve_engines(t, engines))
            for t, engines in zip(transformers, expert_engine_maps(transformers, cache_engines))]


def _recached(transformer, engines, window, prompt_embeds, cache_tag, chunk_frames, commit_noise, image_embeds,
              generator) -> dict[str, RollingKVCacheEngine]:
    """Scratch engines holding ``cache_tag`` re-cached under ``prompt_embeds`` (``engines`` untouched);
    ``commit_noise`` is ``(context_noise, context_noise_mode)``."""
    if not engines or not all(isinstance(e, RollingKVCacheEngine) for e in engines.values()):
        raise TypeError(
            "recache() refills the window of a RollingKVCacheEngine; put one on every branch of "
            "transformer.kv_cache_engines (or cache_engines) before the rollout."
        )
    main = engines["main"]
    held = main.held_frames(cache_tag)
    given = [range(start, start + latents.shape[2]) for start, latents in window]
    if given != held:
        raise ValueError(
            f"cache tag {cache_tag!r} holds frames {_ranges(held)} but the window latents cover {_ranges(given)}; "
            "pass the clean latents of exactly the held frames (StreamingRollout.window keeps them)."
        )
    resume = main.next_frame(cache_tag)
    scratch = {branch: engine.empty_like() for branch, engine in engines.items()}
    for start, latents in window:
        prefill(transformer, latents, prompt_embeds, cache_tag=cache_tag, start_frame=start,
                chunk_frames=recache_schedule(latents.shape[2], chunk_frames), context_noise=commit_noise[0],
                context_noise_mode=commit_noise[1],
                image_embeds=image_embeds, cache_engines=scratch, generator=generator)
    if scratch["main"].next_frame(cache_tag) != resume:  # nothing recent held: continue where the rollout was
        for engine in scratch.values():
            engine.skip_to(resume, cache_tag)
    return scratch


def reset_conditioning(model, cache_tag: str = "pos", cache_engines: dict | None = None) -> None:
    """Switch ``cache_tag`` to new conditioning without re-caching its frames: every engine of the transformer
    drops the tag's cross-attention entries and conditioning fingerprint and keeps its self K/V
    (:meth:`~diffusers_causal_kv.BaseKVCacheEngine.reset_conditioning`). The next chunk is denoised under whatever
    prompt it brings, attending to frames cached under the old one, and its commit stores the new cross entries.
    Cheaper than :func:`recache` (no forward), and what a prompt switch that keeps the recent frames' K/V does;
    every engine (of every expert) is checked before any is changed."""
    maps = [engines for _, engines in expert_engines(model, cache_engines)]
    for engines in maps:
        missing = [branch for branch, engine in engines.items() if cache_tag not in engine.tags()]
        if not engines or missing:
            raise ValueError(
                f"reset_conditioning: cache tag {cache_tag!r} is not filled on branches {missing or ['main']}; a tag "
                "that holds no frames takes any conditioning already."
            )
    for engines in maps:
        for engine in engines.values():
            engine.reset_conditioning(cache_tag)


def recache_schedule(num_frames: int, chunk_frames: int) -> list[int]:
    """Chunks of at most ``chunk_frames`` frames over ``num_frames``, the remainder first (7 in chunks of 3:
    ``[1, 3, 3]``): unlike :func:`~diffusers_causal_kv.chunk_schedule`, no chunk outgrows ``chunk_frames``, which
    a window with sink frames may need."""
    sizes = chunk_schedule(num_frames, chunk_frames)
    if sizes[0] > chunk_frames:
        sizes = [sizes[0] - chunk_frames, chunk_frames, *sizes[1:]]
    return sizes


def _ranges(ranges: Sequence[range]) -> str:
    return "[" + ", ".join(f"{r.start}..{r.stop - 1}" for r in ranges) + "]" if ranges else "[]"


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
        chunk_frames: int = 3,
        timesteps: Sequence[float] = (1000, 750, 500, 250),
        shift: float = 5.0,
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
        self.transformer = resolve_transformer(model)
        kind = topology(self.transformer)
        config = self.transformer.config  # I2V-A14B takes condition latents without image embeddings: told by channels
        self.per_frame_inputs = kind.is_vace or kind.is_i2v or config.in_channels != config.out_channels
        self._planner = RolloutPlanner(model, prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                                       guidance_scale=guidance_scale, cache_engines=cache_engines, generator=generator,
                                       image_embeds=image_embeds, control_scale=control_scale,
                                       attention_kwargs=attention_kwargs, cfg_batch=cfg_batch, **experts)
        self.prompts = self._planner.prompts
        self.guidance_scale, self.chunk_frames = guidance_scale, chunk_frames
        self.timesteps, self.shift = timesteps, shift
        check_context_noise(context_noise, context_noise_mode)
        self.commit_noise = (context_noise, context_noise_mode)
        self.cache_engines, self.generator = cache_engines, generator
        self._window: list[tuple[int, torch.Tensor]] = []
        self._planner.clear()

    @property
    def engine(self) -> BaseKVCacheEngine | None:
        """The engine of the ``"main"`` branch (``None`` before the first forward created it)."""
        return self._planner.engines.get("main")

    @property
    def next_frame(self) -> int:
        """The absolute latent frame the next chunk starts at."""
        return self._planner.next_frame()

    def window(self) -> list[tuple[int, torch.Tensor]]:
        """``(start_frame, clean latents)`` of each range of frames the cache holds (sink, then recent frames)."""
        return list(self._window)

    def memory_bytes(self) -> int:
        """Bytes held by the engines and by the clean latents kept for re-caching."""
        held = sum(e.memory_bytes() for _, engines in self._expert_engines() for e in engines.values())
        return held + sum(t.nbytes for _, t in self._window)

    @torch.no_grad()
    def prefill(self, latents: torch.Tensor, *, condition_latents: torch.Tensor | None = None,
                control_latents: torch.Tensor | None = None) -> None:
        """Continue the rollout with the given clean latents (e.g. the end of a real clip) instead of generating;
        ``condition_latents`` / ``control_latents``: the I2V / VACE inputs of the same frames."""
        self._held_parts(self._window)  # frames committed behind this rollout's back: refuse before any work
        planner = self._planner.with_frames(condition_latents, control_latents)
        for chunk in planner.plan(latents, self.chunk_frames, self.next_frame, given="latents"):
            part = latents[:, :, chunk.offset:chunk.offset + chunk.size]
            planner.commit(part, chunk, *self.commit_noise)  # every tag or none
            self._remember(chunk.frame, part)  # per chunk: an error in a later one leaves this one usable

    @torch.no_grad()
    def generate(self, noise: torch.Tensor, progress: bool = False, *, condition_latents: torch.Tensor | None = None,
                 control_latents: torch.Tensor | None = None, chunk_frames: int | Sequence[int] | None = None,
                 on_step=None) -> RolloutOutput:
        """Denoise ``noise.shape[2]`` more latent frames, chunk by chunk, continuing the cache.

        ``condition_latents`` / ``control_latents``: the I2V / VACE inputs of the same frames. ``chunk_frames``:
        this call's chunk schedule (default: the rollout's). ``on_step(chunk, step, t, latents)``: as in
        :func:`~diffusers_causal_kv.rollout.rollout_chunks`."""
        self._held_parts(self._window)
        planner = self._planner.with_frames(condition_latents, control_latents)
        chunks = planner.plan(noise, self.chunk_frames if chunk_frames is None else chunk_frames, self.next_frame)
        sigmas = shifted_sigmas(self.timesteps, self.shift).tolist()
        planner.check(noise, chunks)  # the whole request, as one causal_rollout call would
        loop = rollout_chunks(planner, chunks, lambda c: noise[:, :, c.offset:c.offset + c.size], sigmas=sigmas,
                              context_noise=self.commit_noise[0], context_noise_mode=self.commit_noise[1],
                              on_step=on_step)
        outputs, seconds = [], []
        # Each committed chunk is remembered at once, so an interrupted generate() leaves the stream consistent with
        # its cache (the chunks before the interruption kept).
        for chunk, x, took in tqdm(loop, total=len(chunks), desc="streaming rollout", unit="chunk",
                                   disable=not progress):
            self._remember(chunk.frame, x)
            seconds.append(took)
            outputs.append(x)
        return RolloutOutput(latents=torch.cat(outputs, dim=2), chunk_sizes=[c.size for c in chunks],
                             chunk_seconds=seconds)

    def switch_prompt(self, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None = None,
                      mode: str = "recache") -> None:
        """Use new conditioning from the next chunk on: the ``"pos"`` tag, and the ``"neg"`` tag too when CFG runs
        and a new negative prompt is given.

        ``mode="recache"`` (LongLive) re-caches the window under the new prompt (:func:`recache`), so the next
        chunks attend to frames whose K/V were computed under it; ``mode="cross"`` only swaps the cross-attention
        entries (:func:`reset_conditioning`): the cached frames keep the K/V of the old prompt (no forward at
        all)."""
        if mode not in ("recache", "cross"):
            raise ValueError(f"switch_prompt mode must be 'recache' or 'cross', got {mode!r}.")
        if mode == "recache" and self.per_frame_inputs:
            raise NotImplementedError(
                "switch_prompt(mode='recache') re-caches text-conditioned streams only (the window's I2V/VACE inputs "
                "are not kept); switch an I2V or VACE stream with mode='cross'."
            )
        new = {"pos": prompt_embeds}
        if negative_prompt_embeds is not None and "neg" in self.prompts:
            new["neg"] = negative_prompt_embeds
        experts = self._expert_engines()
        if mode == "cross":
            for tag, prompt in new.items():
                for _, engines in experts:
                    for engine in engines.values():
                        if tag in engine.tags():  # an unfilled tag takes any conditioning already
                            engine.reset_conditioning(tag)
                self.prompts[tag] = prompt
            return
        # Every tag of every expert is re-cached before any is swapped in, so a failure (say, a malformed negative
        # prompt) leaves the rollout on its old prompts.
        scratch = {(tag, i): _recached(transformer, engines, self._window, prompt, tag, self.chunk_frames,
                                       self.commit_noise, None, self.generator)
                   for tag, prompt in new.items() for i, (transformer, engines) in enumerate(experts)}
        for (tag, i), built in scratch.items():
            for branch, engine in experts[i][1].items():
                engine.adopt_tag(built[branch], tag)
            self.prompts[tag] = new[tag]

    def _expert_engines(self) -> list[tuple[torch.nn.Module, dict]]:
        return [(e.transformer, resolve_engines(e.transformer, e.cache_engines)) for e in self._planner.experts]

    def _remember(self, start: int, latents: torch.Tensor) -> None:
        """Add clean latents of frames ``start...`` and drop those of frames the cache no longer holds."""
        # torch.cat copies: the dropped frames' memory is released
        self._window = [(r.start, torch.cat(parts, dim=2))
                        for r, parts in self._held_parts([*self._window, (start, latents)])]

    def _held_parts(self, pieces: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[range, list[torch.Tensor]]]:
        """For each range of frames the cache holds, the slices of ``pieces`` covering it; raises if any frame the
        cache holds is not in ``pieces``."""
        engine = self.engine
        held = engine.held_frames("pos") if isinstance(engine, RollingKVCacheEngine) else [range(self.next_frame)]
        covered = []
        for r in held:
            if not len(r):
                continue
            parts = [t[:, :, max(r.start, s) - s:min(r.stop, s + t.shape[2]) - s]
                     for s, t in pieces if s < r.stop and r.start < s + t.shape[2]]
            if sum(t.shape[2] for t in parts) != len(r):
                raise RuntimeError(
                    f"the cache holds frames {_ranges([r])} but this StreamingRollout did not commit all of them; "
                    "commit frames through its prefill() and generate() only."
                )
            covered.append((r, parts))
        return covered
