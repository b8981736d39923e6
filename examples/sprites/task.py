"""Synthetic sprite videos: one coloured ball or square moving at constant speed and bouncing off the walls of a
32x32 frame on a plain dark background, with its true position known in every frame, and a prompt describing it.

A prompt reads ``"<colour> <shape> moving <direction>"`` (e.g. ``"red ball moving right"``): the colour and the
shape of the sprite, and the axis and sign of its initial velocity (its speed along that axis is
``MAIN_SPEED``; across it, a random drift in ``[-DRIFT, DRIFT]``). Positions are sprite centres in pixel coordinates
(``x`` = column, ``y`` = row, the pixel ``(i, j)`` centred at ``(j + 0.5, i + 0.5)``); a centre stays in
``[MARGIN, SIZE - MARGIN]`` and is reflected at those bounds, so a bounce keeps the speed and flips one component.

Frames are rendered with anti-aliased edges, so a sub-pixel move changes the pixels, and come as ``float32`` arrays
``[frames, SIZE, SIZE, 3]`` in ``0..1``; :func:`to_model_range` maps them to the ``-1..1`` video tensor the VAE
takes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

SIZE = 32
RADIUS = 3.5  # ball radius / half side of a square, in pixels
MARGIN = RADIUS + 0.5  # a centre within MARGIN of a wall bounces
BACKGROUND = (0.08, 0.08, 0.1)
COLOURS = {
    "red": (0.95, 0.15, 0.12),
    "green": (0.15, 0.85, 0.2),
    "blue": (0.2, 0.35, 1.0),
    "yellow": (0.95, 0.9, 0.1),
}
SHAPES = ("ball", "square")
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
MAIN_SPEED = 1.5  # pixels per frame along the prompt's direction
DRIFT = 0.75  # largest speed across it
PROMPTS = [f"{c} {s} moving {d}" for c, s, d in itertools.product(COLOURS, SHAPES, DIRECTIONS)]


@dataclass(frozen=True)
class Sprite:
    """What a prompt says about a sprite."""

    colour: str
    shape: str
    direction: str

    @property
    def prompt(self) -> str:
        return f"{self.colour} {self.shape} moving {self.direction}"

    @classmethod
    def parse(cls, prompt: str) -> Sprite:
        words = prompt.split()
        if len(words) != 4 or words[0] not in COLOURS or words[1] not in SHAPES or words[3] not in DIRECTIONS:
            raise ValueError(f"not a sprite prompt: {prompt!r}; expected '<colour> <shape> moving <direction>' "
                             f"with colour in {list(COLOURS)}, shape in {list(SHAPES)}, direction in "
                             f"{list(DIRECTIONS)}.")
        return cls(words[0], words[1], words[3])


def reflect(value: np.ndarray, low: float = MARGIN, high: float = SIZE - MARGIN) -> tuple[np.ndarray, np.ndarray]:
    """Fold positions into ``[low, high]`` as walls reflect them; returns ``(position, sign)``, where ``sign`` is -1
    where an odd number of bounces flipped the velocity."""
    span = high - low
    phase = np.mod(value - low, 2 * span)
    flipped = phase > span
    return low + np.where(flipped, 2 * span - phase, phase), np.where(flipped, -1.0, 1.0)


def trajectory(start: np.ndarray, velocity: np.ndarray, num_frames: int) -> np.ndarray:
    """Centres ``[num_frames, 2]`` (x, y) of a sprite starting at ``start`` with ``velocity`` (pixels per frame)."""
    t = np.arange(num_frames, dtype=np.float64)[:, None]
    return reflect(start[None] + t * velocity[None])[0]


def render(centres: np.ndarray, colours: list[str] | str, shape: str) -> np.ndarray:
    """Frames ``[len(centres), SIZE, SIZE, 3]`` in 0..1 with the sprite drawn at each centre (``colours``: one colour
    name, or one per frame)."""
    if isinstance(colours, str):
        colours = [colours] * len(centres)
    grid = np.arange(SIZE, dtype=np.float64) + 0.5
    dx = grid[None, None, :] - centres[:, 0, None, None]
    dy = grid[None, :, None] - centres[:, 1, None, None]
    if shape == "ball":
        coverage = np.clip(RADIUS + 0.5 - np.sqrt(dx**2 + dy**2), 0.0, 1.0)
    else:
        coverage = (np.clip(RADIUS + 0.5 - np.abs(dx), 0.0, 1.0) * np.clip(RADIUS + 0.5 - np.abs(dy), 0.0, 1.0))
    colour = np.array([COLOURS[c] for c in colours])[:, None, None, :]
    background = np.array(BACKGROUND)[None, None, None, :]
    frames = background + coverage[..., None] * (colour - background)
    return frames.astype(np.float32)


@dataclass
class Clip:
    """One sampled video: frames ``[F, SIZE, SIZE, 3]`` in 0..1, true centres ``[F, 2]``, the prompt per frame
    (the same everywhere unless the colour switches), and the sprite's initial velocity."""

    frames: np.ndarray
    centres: np.ndarray
    prompts: list[str]
    velocity: np.ndarray

    def moving_prompt(self, frame: int) -> str:
        """Frame ``frame``'s prompt with the direction the sprite moves from there: a clip's prompts name its initial
        direction, which a bounce off the wall ahead reverses (every clip longer than ~16 frames bounces), so a
        crop that starts after one shows the opposite motion to the clip's prompt."""
        sprite = Sprite.parse(self.prompts[frame])
        sign = reflect(self.centres[0] + frame * self.velocity)[1]
        heading = np.array(DIRECTIONS[sprite.direction]) * sign
        direction = next(name for name, axis in DIRECTIONS.items() if np.array_equal(axis, heading))
        return Sprite(sprite.colour, sprite.shape, direction).prompt


def sample_velocity(direction: str, rng: np.random.Generator) -> np.ndarray:
    main = np.array(DIRECTIONS[direction]) * MAIN_SPEED
    across = np.array(DIRECTIONS[direction][::-1]) * rng.uniform(-DRIFT, DRIFT)
    return main + across


def sample_clip(num_frames: int, rng: np.random.Generator, prompt: str | None = None,
                switch_at: int | None = None, switch_colour: str | None = None) -> Clip:
    """A random clip of ``num_frames`` frames following ``prompt`` (random when ``None``). With ``switch_at``, the
    sprite takes ``switch_colour`` (random other colour when ``None``) from that frame on, and the prompts of those
    frames say so."""
    sprite = Sprite.parse(prompt) if prompt is not None else Sprite.parse(PROMPTS[rng.integers(len(PROMPTS))])
    velocity = sample_velocity(sprite.direction, rng)
    start = rng.uniform(MARGIN, SIZE - MARGIN, size=2)
    centres = trajectory(start, velocity, num_frames)
    colours = [sprite.colour] * num_frames
    prompts = [sprite.prompt] * num_frames
    if switch_at is not None:
        if switch_colour is None:
            others = [c for c in COLOURS if c != sprite.colour]
            switch_colour = others[rng.integers(len(others))]
        switched = Sprite(switch_colour, sprite.shape, sprite.direction).prompt
        colours[switch_at:] = [switch_colour] * (num_frames - switch_at)
        prompts[switch_at:] = [switched] * (num_frames - switch_at)
    return Clip(render(centres, colours, sprite.shape), centres, prompts, velocity)


def to_model_range(frames: np.ndarray) -> torch.Tensor:
    """Frames ``[F, H, W, 3]`` in 0..1 -> the VAE's video tensor ``[1, 3, F, H, W]`` in -1..1."""
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None] * 2 - 1


def from_model_range(video: torch.Tensor) -> np.ndarray:
    """The inverse of :func:`to_model_range` (clamped): ``[1, 3, F, H, W]`` -> ``[F, H, W, 3]`` in 0..1."""
    return ((video[0].permute(1, 2, 3, 0).float() + 1) / 2).clamp(0, 1).numpy()
