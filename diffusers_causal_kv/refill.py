"""Filling a cache from clean latents: prefill a clip, re-cache a window under a new prompt, switch conditioning.

* :func:`prefill` commits given clean latents chunk by chunk (commit passes only, no denoising), so a rollout can
  continue a real clip.
* :func:`recache` switches a tag to new conditioning, as LongLive does on a prompt switch: it recomputes the self K/V
  of the frames still in the window under the new prompt (the sink frames first, then the recent ones at their own
  frame indices), from their clean latents, with new cross-attention entries.
* :func:`reset_conditioning` switches a tag's cross-attention entries only.

Each works on a :class:`~diffusers_causal_kv.RolloutPlanner` (:func:`commit_clean`, :func:`recached_engines`), so
a session re-caches with everything its forwards use (Wan2.2 TI2V's per-token timesteps and first frame, both A14B
experts, image embeddings). Failures: a re-cache builds the new tag in scratch engines and swaps them in at the end,
so an error leaves the old tag as it was; a prefill commits chunk by chunk, each chunk atomically, and undoes a skip
that no chunk followed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .causal_config import DEFAULTS
from .masks import chunk_schedule
from .model import experts_of, resolve_engines
from .planner import RolloutPlanner, check_context_noise, expert_engine_maps


def expert_engines(model, cache_engines: dict | None = None) -> list[tuple[torch.nn.Module, dict]]:
    """``(transformer, engine map)`` of every expert of ``model`` (one, or the two of Wan2.2 A14B)."""
    transformers = experts_of(model)
    return [(t, resolve_engines(t, engines))
            for t, engines in zip(transformers, expert_engine_maps(transformers, cache_engines))]


def planner_engines(planner: RolloutPlanner) -> list[dict]:
    """The engine map of every expert of ``planner``, in order."""
    return [resolve_engines(e.transformer, e.cache_engines) for e in planner.experts]


def commit_clean(planner: RolloutPlanner, latents: torch.Tensor, start_frame: int | None,
                 chunk_frames: int | Sequence[int], context_noise: float = 0.0, mode: str = "label") -> int:
    """Commit clean ``latents`` on the planner's tags, chunk by chunk, from absolute frame ``start_frame``
    (``None``: where the tag continues; later: skip the frames in between, on engines that ``supports_refill``).
    Returns the frame the tag continues at."""
    cached = planner.next_frame()
    engines = [e for m in planner_engines(planner) for e in m.values()]  # every expert: a skip moves every cache
    start = cached if start_frame is None else start_frame
    chunks = planner.plan(latents, chunk_frames, start, given="latents")  # every check before a skip changes anything
    check_context_noise(context_noise, mode)
    if start != cached and (start < cached or not engines or not all(e.supports_refill for e in engines)):
        raise ValueError(
            f"prefill(start_frame={start}) on cache tag {planner.cache_tag!r}, which continues at frame {cached}: "
            f"pass start_frame={cached} (or None), crop the cache first, or skip forward on a RollingKVCacheEngine."
        )
    with contextlib.ExitStack() as skips:
        if start != cached:
            for engine in engines:
                skips.enter_context(engine.skipping_to(start, planner.cache_tag))
        for chunk in chunks:
            planner.commit(latents[:, :, chunk.offset:chunk.offset + chunk.size], chunk, context_noise, mode)
    return start + latents.shape[2]


@torch.no_grad()
def prefill(model, latents: torch.Tensor, prompt_embeds: torch.Tensor, *, cache_tag: str = "pos",
            start_frame: int | None = None, chunk_frames: int | Sequence[int] = DEFAULTS.chunk_frames,
            context_noise: float = 0.0, context_noise_mode: str = "label", image_embeds: torch.Tensor | None = None,
            condition_latents: torch.Tensor | None = None, control_latents: torch.Tensor | None = None,
            control_scale: torch.Tensor | None = None, cache_engines: dict | None = None,
            generator: torch.Generator | None = None) -> int:
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
    return commit_clean(planner, latents, start_frame, chunk_frames, context_noise, context_noise_mode)


def recached_engines(planner: RolloutPlanner, window: Sequence[tuple[int, torch.Tensor]], cache_tag: str,
                     prompt_embeds: torch.Tensor, chunk_frames: int, context_noise: float = 0.0,
                     mode: str = "label") -> list[dict]:
    """Scratch engines (one map per expert of ``planner``) holding ``cache_tag`` re-cached under ``prompt_embeds``
    from the clean latents ``window`` (``(start_frame, latents)`` of each range the tag holds); the planner's engines
    are untouched. Swap them in with :func:`adopt`."""
    maps = planner_engines(planner)
    if not all(m and all(e.supports_refill for e in m.values()) for m in maps):
        raise TypeError(
            "a re-cache refills the window of a RollingKVCacheEngine (an engine that supports_refill); put one on "
            "every branch of transformer.kv_cache_engines (or cache_engines) before the rollout."
        )
    main = maps[0]["main"]
    held = main.held_frames(cache_tag)
    given = [range(start, start + latents.shape[2]) for start, latents in window]
    if given != held:
        raise ValueError(
            f"cache tag {cache_tag!r} holds frames {_ranges(held)} but the window latents cover {_ranges(given)}; "
            "pass the clean latents of exactly the held frames (StreamingRollout.window keeps them)."
        )
    resume = main.next_frame(cache_tag)
    scratch = [{branch: engine.empty_like() for branch, engine in m.items()} for m in maps]
    tagged = planner.for_tag(cache_tag, prompt_embeds, scratch)
    for start, latents in window:
        commit_clean(tagged, latents, start, recache_schedule(latents.shape[2], chunk_frames), context_noise, mode)
    if scratch[0]["main"].next_frame(cache_tag) != resume:  # nothing recent held: continue where the rollout was
        for engine in (e for m in scratch for e in m.values()):
            engine.skip_to(resume, cache_tag)
    return scratch


def adopt(planner: RolloutPlanner, scratch: list[dict], cache_tag: str) -> None:
    """Swap the re-cached ``cache_tag`` of :func:`recached_engines` into the planner's engines."""
    for engines, built in zip(planner_engines(planner), scratch):
        for branch, engine in engines.items():
            engine.adopt_tag(built[branch], cache_tag)


@torch.no_grad()
def recache(model, window: Sequence[tuple[int, torch.Tensor]], prompt_embeds: torch.Tensor, *,
            cache_tag: str = "pos", chunk_frames: int = DEFAULTS.chunk_frames, context_noise: float = 0.0,
            context_noise_mode: str = "label", image_embeds: torch.Tensor | None = None,
            cache_engines: dict | None = None, generator: torch.Generator | None = None) -> None:
    """Re-cache ``cache_tag`` under new conditioning: prefill the frames the tag still holds, from their clean
    latents, with ``prompt_embeds``, into a fresh tag (its cross entries included) that replaces the old one. The tag
    then continues at the frame it continued at before. The new tag is built in scratch engines and handed over only
    once every forward succeeded, so an error leaves the old tag as it was (at the cost of holding the tag twice
    meanwhile).

    Arguments not listed below are as in :func:`prefill`.

    Args:
        window: ``(start_frame, clean latents)`` for each range of :meth:`RollingKVCacheEngine.held_frames`
            (the sink frames, then the recent ones), as :meth:`StreamingRollout.window` gives them.
        chunk_frames: the most frames per commit pass; each range is split into such chunks with the remainder
            as a chunk of its own at the start (:func:`recache_schedule`), so every chunk fits the window.
    """
    planner = RolloutPlanner(model, prompt_embeds, cache_tag=cache_tag, image_embeds=image_embeds,
                             cache_engines=cache_engines, generator=generator)
    adopt(planner, recached_engines(planner, window, cache_tag, prompt_embeds, chunk_frames, context_noise,
                                    context_noise_mode), cache_tag)


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
