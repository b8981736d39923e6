"""Admission by memory: what a session's cache will hold, known before its first chunk, against the server's budget.

A stream's engines are bounded (the rolling window of :meth:`CausalWanPipeline.stream`), so the memory its session
holds stops growing once the window is full: per expert, branch, block and cache tag, the self-attention K/V of
``window_frames - 1`` latent frames and the cross-attention K/V of the prompt's tokens (what
:meth:`CausalWanPipeline.cache_memory_bytes` counts of its engines), plus the clean latents of the held frames the
session keeps to re-cache on a prompt switch (what :meth:`RolloutSession.memory_bytes` adds).
"""

from __future__ import annotations

import os

import torch

from ..model import topology


def session_cache_bytes(stream) -> int:
    """Bytes ``stream``'s session holds once its window is full (and at most before), from its engines' window, its
    transformers' shapes and its prompts; nothing is run."""
    session = stream.session
    batch, channels, height, width = session.latent_shape
    held, total = None, 0
    for expert, engines in zip(session.planner.experts, session.engine_maps()):
        transformer, config = expert.transformer, expert.transformer.config
        _, patch_h, patch_w = config.patch_size
        frame_tokens = (height // patch_h) * (width // patch_w)
        row = config.num_attention_heads * config.attention_head_dim * transformer.dtype.itemsize
        branches = topology(transformer).branches
        for branch, engine in engines.items():
            window = engine.window_frames  # a stream's engines are rolling ones
            held = window - 1 if held is None else held
            blocks = len(branches[branch])
            for embeds in session.prompts.values():
                total += 2 * batch * blocks * row * ((window - 1) * frame_tokens + embeds.shape[1])
    latents = batch * channels * held * height * width * torch.finfo(torch.float32).bits // 8
    return total + latents


def default_budget(device: torch.device) -> int:
    """Bytes the sessions' caches may hold together by default: 80% of the device's free memory now (after the
    model was loaded), leaving the rest for the forwards' activations and the decoder."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * 0.8)


def retry_hint(need: int, budget: int, running: list[tuple[int, float | None]]) -> tuple[str, float | None]:
    """When a refused session of ``need`` bytes could start: ``running`` holds ``(bytes, seconds until it ends)`` of
    each session (``None``: it streams until stopped). Returns the advice and the seconds to wait (``None`` when only
    a stop frees enough)."""
    if need > budget:
        return (f"this session alone needs {_mib(need)} of cache, more than the server's whole budget of "
                f"{_mib(budget)}; ask for a smaller resolution, fewer chunk frames or no guidance.", None)
    free = budget - sum(size for size, _ in running)
    for size, seconds in sorted((r for r in running if r[1] is not None), key=lambda r: r[1]):
        free += size
        if free >= need:
            return f"retry in about {seconds:.0f} s, when running sessions end.", seconds
    return "retry when another session stops (the running ones stream until stopped).", None


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
