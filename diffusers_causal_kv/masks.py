"""Self-attention masks of causal video training, given a chunk schedule and the tokens per latent frame.

Two patterns, each with an optional sliding window and attention sink:

``block_causal_mask`` (diffusion forcing, causal pretraining; the mask a cached rollout is equivalent to)
    One sequence ``[chunk 0 | chunk 1 | ...]``; every token of chunk *k* attends to every token of chunks
    ``0..k``.
``teacher_forcing_mask`` (CausVid-style teacher forcing)
    The sequence ``[clean context | noisy frames]``, both halves with the same chunk schedule. Clean chunks attend
    block-causally among themselves; noisy chunk *k* attends to the clean chunks before it and to itself, exactly
    what a cached rollout's chunk *k* sees when the clean chunks were committed.

Window and sink (how rolling-cache models are trained): with ``window_frames=W`` and ``sink_frames=S``, a chunk
ending at frame *e* (exclusive) attends to at most ``W`` frames: the first ``S`` frames of the sequence, kept
forever, and the ``W - S`` frames before *e*, the chunk itself included. Each chunk must fit in ``W - S``.

Chunk schedules follow :func:`chunk_schedule`: an int splits the frames evenly and the first chunk absorbs the
remainder, a list is taken as is. A :class:`CausalMask` is stored per frame and expanded on demand to a dense
boolean token mask (``True`` = attend, for SDPA and every dense backend) or a FlexAttention ``BlockMask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def chunk_schedule(num_frames: int, chunk_frames: int | Sequence[int]) -> list[int]:
    """Latent frames per chunk. An int splits ``num_frames`` evenly with the remainder absorbed by the first chunk
    (21 frames in chunks of 4: ``[5, 4, 4, 4, 4]``); a list is taken as is and must add up to ``num_frames``."""
    if isinstance(chunk_frames, int):
        if chunk_frames <= 0:
            raise ValueError(f"chunk_frames must be positive, got {chunk_frames}.")
        count = max(num_frames // chunk_frames, 1)
        return [num_frames - chunk_frames * (count - 1)] + [chunk_frames] * (count - 1)
    sizes = list(chunk_frames)
    if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes) or sum(sizes) != num_frames:
        raise ValueError(
            f"chunk sizes {sizes} must be positive ints adding up to the {num_frames} latent frames"
            f"{_schedule_suggestion(num_frames)}."
        )
    return sizes


def _schedule_suggestion(num_frames) -> str:
    """A valid schedule for ``num_frames`` to quote in the error: chunks of 3 with the remainder (1 to 3 frames)
    first, e.g. ``[3] + [3] * 2`` for 9 frames or ``[1] + [3] * 3`` for 10 (an independent first frame)."""
    if not isinstance(num_frames, int) or num_frames <= 0:
        return " (there are no frames to split: pass latents with at least one frame)"
    count = (num_frames - 1) // 3
    first = num_frames - 3 * count
    if count == 0:
        return f"; e.g. [{first}]"
    return f"; e.g. [{first}] + [3] * {count}" + (" for an independent first frame" if first == 1 else "")


@dataclass(frozen=True, eq=False)
class CausalMask:
    """A self-attention mask stored per latent frame.

    Attributes:
        kind: the pattern, ``"block_causal"`` or ``"teacher_forcing"`` (also the :class:`CausalContext` mode it
            serves).
        allowed: ``[frames, frames]`` bool, ``allowed[q, k]`` iff query frame ``q`` attends to key frame ``k``.
        frame_tokens: tokens per latent frame (post-patch height x width).
        chunk_sizes: the chunk schedule of the mask (of one half, for teacher forcing).
    """

    kind: str
    allowed: torch.Tensor
    frame_tokens: int
    chunk_sizes: tuple[int, ...]
    _block_masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_frames(self) -> int:
        """Latent frames the mask covers (both halves, for teacher forcing)."""
        return self.allowed.shape[0]

    @property
    def seq_len(self) -> int:
        """Tokens the mask covers, ``num_frames * frame_tokens``: the side of :meth:`dense`."""
        return self.num_frames * self.frame_tokens

    def dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[seq_len, seq_len]`` bool token mask, ``True`` = attend."""
        allowed = self.allowed.to(device)
        return allowed.repeat_interleave(self.frame_tokens, 0).repeat_interleave(self.frame_tokens, 1)

    def block_mask(self, device: torch.device | str | None = None):
        """The same mask as a FlexAttention ``BlockMask`` (built once per device and reused)."""
        from torch.nn.attention.flex_attention import create_block_mask

        device = torch.device("cpu" if device is None else device)
        if device not in self._block_masks:
            allowed, tokens = self.allowed.to(device), self.frame_tokens

            def mask_mod(batch, head, q_idx, kv_idx):
                return allowed[q_idx // tokens, kv_idx // tokens]

            self._block_masks[device] = create_block_mask(
                mask_mod, None, None, self.seq_len, self.seq_len, device=device
            )
        return self._block_masks[device]

    def __repr__(self) -> str:
        return (
            f"CausalMask({self.kind!r}, chunks={list(self.chunk_sizes)}, frames={self.num_frames}, "
            f"frame_tokens={self.frame_tokens})"
        )


def block_causal_mask(num_frames: int, chunk_frames: int | Sequence[int], frame_tokens: int, *,
                      window_frames: int | None = None, sink_frames: int = 0) -> CausalMask:
    """Chunk *k* attends to chunks ``0..k`` (within the window and sink, if given). See the module docstring."""
    sizes = chunk_schedule(num_frames, chunk_frames)
    visible = _visible_frames(sizes, frame_tokens, window_frames, sink_frames)
    chunk_of = _chunk_of_frame(sizes)
    allowed = visible[chunk_of] & (torch.arange(num_frames)[None, :] < _chunk_ends(sizes)[chunk_of][:, None])
    return CausalMask("block_causal", allowed, frame_tokens, tuple(sizes))


def teacher_forcing_mask(num_frames: int, chunk_frames: int | Sequence[int], frame_tokens: int, *,
                         window_frames: int | None = None, sink_frames: int = 0) -> CausalMask:
    """The mask of ``[clean | noisy]``, ``num_frames`` frames per half (``2 * num_frames`` in all): clean chunks
    attend block-causally, noisy chunk *k* to the clean chunks before it and to itself. See the module docstring."""
    clean = block_causal_mask(num_frames, chunk_frames, frame_tokens, window_frames=window_frames,
                              sink_frames=sink_frames)
    sizes = list(clean.chunk_sizes)
    chunk_of = _chunk_of_frame(sizes)
    starts = _chunk_ends(sizes) - torch.tensor(sizes)
    frames = torch.arange(num_frames)
    earlier_clean = clean.allowed & (frames[None, :] < starts[chunk_of][:, None])
    same_chunk = chunk_of[:, None] == chunk_of[None, :]
    allowed = torch.zeros(2 * num_frames, 2 * num_frames, dtype=torch.bool)
    allowed[:num_frames, :num_frames] = clean.allowed
    allowed[num_frames:, :num_frames] = earlier_clean
    allowed[num_frames:, num_frames:] = same_chunk
    return CausalMask("teacher_forcing", allowed, frame_tokens, tuple(sizes))


def _visible_frames(sizes: list[int], frame_tokens: int, window_frames: int | None, sink_frames: int):
    """``[chunks, frames]`` bool: the frames each chunk may see by the window-and-sink rule (causality aside)."""
    num_frames = sum(sizes)
    if not isinstance(frame_tokens, int) or frame_tokens <= 0:
        raise ValueError(f"frame_tokens must be a positive int (post-patch height x width), got {frame_tokens}.")
    if window_frames is None:
        if sink_frames:
            raise ValueError("sink_frames needs window_frames: a sink only matters when a window evicts frames.")
        return torch.ones(len(sizes), num_frames, dtype=torch.bool)
    if window_frames <= 0 or sink_frames < 0 or sink_frames >= window_frames:
        raise ValueError(
            f"need window_frames > sink_frames >= 0, got window_frames={window_frames}, sink_frames={sink_frames}."
        )
    recent = window_frames - sink_frames
    if max(sizes) > recent:
        raise ValueError(
            f"a chunk of {max(sizes)} frames does not fit the window's {recent} non-sink frames "
            f"(window_frames={window_frames}, sink_frames={sink_frames}); use smaller chunks or a larger window."
        )
    frames = torch.arange(num_frames)[None, :]
    ends = _chunk_ends(sizes)[:, None]
    return (frames < sink_frames) | (frames >= ends - recent)


def _chunk_of_frame(sizes: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def _chunk_ends(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0)
