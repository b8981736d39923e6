"""Does a generated sprite video do what its prompt says? Per frame: is there a sprite, of which colour and shape;
per video: which way it starts off and how fast it moves; for a prompt switch: when the new colour shows.

* **present**: some task colour's sprite mass (:func:`track.coverage` summed) lies within ``track.MASS_RANGE`` times
  a rendered sprite's; the frame's colour is the task colour with the largest mass.
* **shape**: the frame's coverage of its colour against a rendered ball and a rendered square centred on the same
  centroid: the closer one (L1) is the frame's shape.
* **direction**: over the steps between the first :data:`START_FRAMES` frames, a step goes the prompt's way when it
  moves mostly along the prompt's axis, with the prompt's sign, or against it within :data:`BOUNCE_ROOM` px of the
  wall the prompt heads to (it bounced there); the video starts off the prompt's way when at least half of its
  steps do.
* **speed**: the distance moved between consecutive frames that both show a sprite; the task's own sprites move
  :data:`TASK_SPEED` px/frame (median of the rendered clips).

:func:`judge` scores one video against its prompt; :func:`summary` pools several.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import task, track


def _task_speed(num_clips: int = 256, seed: int = 7) -> float:
    rng = np.random.default_rng(seed)
    speeds = [np.linalg.norm(task.sample_velocity(task.Sprite.parse(task.PROMPTS[i % len(task.PROMPTS)]).direction,
                                                  rng)) for i in range(num_clips)]
    return float(np.median(speeds))


TASK_SPEED = _task_speed()  # px/frame: 1.5 along the prompt's direction, a random drift across it
START_FRAMES = 3  # "starts off": the first three frames, whatever the model's chunks (with chunks 1, 3, ...: the
# first frame and two frames of the chunk after it)
BOUNCE_ROOM = 3.4  # px: a step back from a wall this close to it follows a bounce (two steps at the task's speeds)


def frame_colours(frames: np.ndarray) -> tuple[list[str | None], dict[str, np.ndarray]]:
    """Per frame, the colour of the sprite found (``None``: no sprite), and each colour's coverage ``[F, H, W]``."""
    cover = {c: track.coverage(frames, c) for c in task.COLOURS}
    mass = np.stack([cover[c].sum(axis=(1, 2)) for c in task.COLOURS], axis=1)  # [F, colours]
    low, high = (bound * min(track.SPRITE_MASS.values()) for bound in track.MASS_RANGE)
    names = list(task.COLOURS)
    out = []
    for row in mass:
        best = int(row.argmax())
        out.append(names[best] if low <= row[best] <= high * max(track.SPRITE_MASS.values()) /
                   min(track.SPRITE_MASS.values()) else None)
    return out, cover


def frame_shape(cover: np.ndarray) -> str:
    """The shape whose rendering at the centroid of ``cover`` (``[H, W]``) is closest to it."""
    grid = np.arange(task.SIZE) + 0.5
    mass = cover.sum()
    centre = np.array([[(cover.sum(axis=0) * grid).sum() / mass, (cover.sum(axis=1) * grid).sum() / mass]])
    distances = {s: np.abs(track.coverage(task.render(centre, "red", s), "red")[0] - cover).sum()
                 for s in task.SHAPES}
    return min(distances, key=distances.get)


@dataclass
class Verdict:
    """One video judged against its prompt."""

    present: np.ndarray  # [F] bool: a sprite is found
    colour_right: np.ndarray  # [F] bool: the prompt's colour (False where no sprite)
    shape_right: np.ndarray  # [F] bool: the prompt's shape (False where no sprite)
    direction_right: bool  # starts off the prompt's way
    speeds: np.ndarray  # px/frame between consecutive frames with a sprite
    colours: list  # per frame, the colour found or None


def judge(frames: np.ndarray, prompt: str | list[str], start_frames: int = START_FRAMES) -> Verdict:
    """Score ``frames`` (``[F, H, W, 3]`` in 0..1) against ``prompt`` (one, or one per frame for a switch); the
    direction over the first ``start_frames`` frames."""
    prompts = [prompt] * len(frames) if isinstance(prompt, str) else list(prompt)
    sprites = [task.Sprite.parse(p) for p in prompts]
    colours, cover = frame_colours(frames)
    present = np.array([c is not None for c in colours])
    colour_right = np.array([c == s.colour for c, s in zip(colours, sprites)])
    shape_right = np.array([c is not None and frame_shape(cover[c][i]) == s.shape
                            for i, (c, s) in enumerate(zip(colours, sprites))])
    grid = np.arange(task.SIZE) + 0.5
    centres = np.full((len(frames), 2), np.nan)
    for i, c in enumerate(colours):
        if c is not None:
            m = cover[c][i]
            centres[i] = [(m.sum(axis=0) * grid).sum() / m.sum(), (m.sum(axis=1) * grid).sum() / m.sum()]
    steps = np.diff(centres, axis=0)
    speeds = np.linalg.norm(steps, axis=1)
    axis = np.array(task.DIRECTIONS[sprites[0].direction])
    wall = task.SIZE - task.MARGIN if axis.sum() > 0 else task.MARGIN  # the wall the prompt heads to
    near_wall = np.abs(centres @ np.abs(axis) - wall) < BOUNCE_ROOM
    along, across = steps @ axis, np.abs(steps @ axis[::-1])
    right_way = (np.abs(along) > across) & ((along > 0) | near_wall[:-1] | near_wall[1:])
    first = np.isfinite(steps).all(axis=1)[:start_frames - 1]
    direction_right = bool(first.any() and right_way[:start_frames - 1][first].mean() >= 0.5)
    return Verdict(present, colour_right, shape_right, direction_right, speeds[np.isfinite(speeds)], colours)


def summary(verdicts: list[Verdict]) -> dict:
    """Pooled over videos: fractions of frames with a sprite, of frames (all) in the prompt's colour, of frames with
    a sprite in the prompt's shape; videos starting off the right way; the median speed and its ratio to the
    task's."""
    present = np.concatenate([v.present for v in verdicts])
    colour = np.concatenate([v.colour_right for v in verdicts])
    shape = np.concatenate([v.shape_right for v in verdicts])
    speeds = np.concatenate([v.speeds for v in verdicts]) if verdicts else np.array([])
    speed = float(np.median(speeds)) if speeds.size else 0.0
    return {
        "present": float(present.mean()),
        "colour": float(colour.mean()),
        "shape": float(shape[present].mean()) if present.any() else 0.0,
        "direction": int(sum(v.direction_right for v in verdicts)),
        "videos": len(verdicts),
        "speed": speed,
        "speed_ratio": speed / TASK_SPEED,
    }


def chunks_to_new_colour(verdict: Verdict, colour: str, switch_frame: int, chunk_frames: int) -> int | None:
    """Chunks after a switch at ``switch_frame`` until a frame shows ``colour`` (1: the first chunk after it), or
    ``None`` if none does."""
    for i in range(switch_frame, len(verdict.colours)):
        if verdict.colours[i] == colour:
            return (i - switch_frame) // chunk_frames + 1
    return None
