"""A colour-threshold sprite tracker and the task's physics check: generated frames -> trajectories -> per-chunk
metrics.

Tracking: for a sprite colour ``c`` and the background ``b``, each pixel ``p`` gets a coverage
``alpha = <p - b, c - b> / |c - b|^2`` (clipped to 0..1), kept where the pixel lies near the segment from ``b`` to
``c`` (``|p - b - alpha (c - b)| < COLOUR_TOLERANCE``), so anti-aliased edges count partly and other colours not at
all. The sprite is *present* when its mass (summed coverage) is between ``MASS_RANGE`` times the mass of a rendered
sprite; its position is the coverage-weighted centroid.

Physics: with positions ``c[t-1], c[t]`` the next one is ``fold(c[t] + v)`` with ``v = c[t] - c[t-1]``, the fold
reflecting at the walls; a bounce between ``t-1`` and ``t`` makes the measured ``v`` wrong, so per axis the error is
the smallest over the three hypotheses "no bounce", "bounced off the low wall", "bounced off the high wall" (the
velocity unfolded through that wall). On the task's own trajectories this error is 0 up to float rounding; a sprite
that jumps, stops, reverses or wanders away from a straight line gets an error in pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import task

COLOUR_TOLERANCE = 0.3
MASS_RANGE = (0.4, 2.5)
def coverage(frames: np.ndarray, colour: str) -> np.ndarray:
    """Per-pixel coverage ``[F, H, W]`` in 0..1 of a sprite of ``colour`` in ``frames`` ``[F, H, W, 3]`` (0..1)."""
    background = np.array(task.BACKGROUND)
    direction = np.array(task.COLOURS[colour]) - background
    offset = frames - background
    alpha = np.clip(offset @ direction / (direction @ direction), 0.0, 1.0)
    residual = np.linalg.norm(offset - alpha[..., None] * direction, axis=-1)
    return np.where(residual < COLOUR_TOLERANCE, alpha, 0.0)


SPRITE_MASS = {shape: float(coverage(task.render(np.array([[16.0, 16.0]]), "red", shape), "red").sum())
               for shape in task.SHAPES}  # summed coverage of one rendered sprite


def track(frames: np.ndarray, colours: list[str] | str, shape: str = "ball") -> tuple[np.ndarray, np.ndarray]:
    """``(centres [F, 2] (x, y), present [F])`` of the sprite of ``colours`` (one name or one per frame); centres
    are NaN where the sprite is absent."""
    if isinstance(colours, str):
        colours = [colours] * len(frames)
    centres = np.full((len(frames), 2), np.nan)
    present = np.zeros(len(frames), dtype=bool)
    grid = np.arange(task.SIZE) + 0.5
    low, high = (bound * SPRITE_MASS[shape] for bound in MASS_RANGE)
    for colour in set(colours):
        rows = [i for i, c in enumerate(colours) if c == colour]
        cover = coverage(frames[rows], colour)
        mass = cover.sum(axis=(1, 2))
        ok = (mass >= low) & (mass <= high)
        safe = np.maximum(mass, 1e-9)
        x = (cover.sum(axis=1) * grid).sum(axis=1) / safe
        y = (cover.sum(axis=2) * grid).sum(axis=1) / safe
        centres[rows] = np.where(ok[:, None], np.stack([x, y], axis=1), np.nan)
        present[rows] = ok
    return centres, present


def physics_errors(centres: np.ndarray) -> np.ndarray:
    """Per frame ``t`` (from 2 on), the distance in pixels between ``centres[t]`` and its constant-velocity-with-
    bounces prediction from ``t-2, t-1`` (NaN where one of the three is missing); ``[F]``, the first two NaN."""
    errors = np.full(len(centres), np.nan)
    low, high = task.MARGIN, task.SIZE - task.MARGIN
    for t in range(2, len(centres)):
        before, now, after = centres[t - 2], centres[t - 1], centres[t]
        if np.isnan(before).any() or np.isnan(now).any() or np.isnan(after).any():
            continue
        per_axis = []
        for axis in range(2):
            velocities = (now[axis] - before[axis], 2 * low - now[axis] - before[axis],
                          2 * high - now[axis] - before[axis])
            candidates = []
            for i, v in enumerate(velocities):
                # a bounce between t-2 and t-1 reverses the unfolded velocity
                step = v if i == 0 else -v
                candidates.append(abs(task.reflect(np.array(now[axis] + step), low, high)[0] - after[axis]))
            per_axis.append(min(candidates))
        errors[t] = float(np.hypot(*per_axis))
    return errors


@dataclass
class ChunkMetrics:
    """Metrics of one chunk of frames (see :func:`chunk_metrics`)."""

    present: float  # fraction of the chunk's frames in which the sprite is found
    physics_px: float  # mean physics error (pixels) over the chunk's frames that have one
    speed_px: float  # mean distance moved per frame (pixels), over the chunk's frames
    pixel_drift: float  # |mean - reference mean| + |std - reference std| of the chunk's pixels


REFERENCE_STATS = None


def reference_statistics(num_clips: int = 64, seed: int = 1234) -> tuple[float, float]:
    """Mean and standard deviation of the task's frames (rendered, not generated)."""
    global REFERENCE_STATS
    if REFERENCE_STATS is None:
        rng = np.random.default_rng(seed)
        frames = np.concatenate([task.sample_clip(8, rng).frames for _ in range(num_clips)])
        REFERENCE_STATS = (float(frames.mean()), float(frames.std()))
    return REFERENCE_STATS


def chunk_metrics(frames: np.ndarray, colours: list[str] | str, shape: str, chunk_frames: int,
                  first_chunk: int | None = None) -> list[ChunkMetrics]:
    """Per chunk of ``chunk_frames`` frames (``first_chunk`` frames for the first one, default the remainder rule
    of ``chunk_schedule`` with video frames = latent frames): presence, physics error, speed, pixel drift."""
    centres, present = track(frames, colours, shape)
    errors = physics_errors(centres)
    speeds = np.full(len(frames), np.nan)
    speeds[1:] = np.linalg.norm(np.diff(centres, axis=0), axis=1)
    mean, std = reference_statistics()
    total = len(frames)
    first = first_chunk if first_chunk is not None else chunk_frames + total % chunk_frames
    bounds = [0, min(first, total)]
    while bounds[-1] < total:
        bounds.append(min(bounds[-1] + chunk_frames, total))
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunk = frames[a:b]
        with np.errstate(all="ignore"):
            physics = float(np.nanmean(errors[a:b])) if np.isfinite(errors[a:b]).any() else float("nan")
            speed = float(np.nanmean(speeds[a:b])) if np.isfinite(speeds[a:b]).any() else float("nan")
        out.append(ChunkMetrics(present=float(present[a:b].mean()), physics_px=physics, speed_px=speed,
                                pixel_drift=abs(float(chunk.mean()) - mean) + abs(float(chunk.std()) - std)))
    return out
