"""Wan's rotary position embedding as plain tensor math (a leaf: it imports nothing of the package).

The stock ``WanRotaryPosEmbed`` numbers the latent frames of its input ``0..F-1``; a causal chunk needs other temporal
positions (its own start frame, or positions inside a window). Everything here reads the rope module's own
``t_dim/h_dim/w_dim`` split and frequency tables, so any head dim works, not only multiples of 6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding (the same arithmetic as the stock processor, so results are bitwise)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def rope_for_frames(rope: torch.nn.Module, frame_positions: torch.Tensor, height: int, width: int,
                    first_row: int = 0):
    """``(freqs_cos, freqs_sin)`` of shape ``[1, F*height*width, 1, head_dim]`` for temporal positions
    ``frame_positions`` (``[F]``, any integers inside the table) on a post-patch ``height x width`` grid of the
    ``WanRotaryPosEmbed`` module ``rope`` whose rows start at row ``first_row`` (a rank's rows under context
    parallelism)."""
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    num_frames = frame_positions.numel()
    shape = (num_frames, height, width, -1)

    def grid(table: torch.Tensor) -> torch.Tensor:
        t, h, w = table.split(split, dim=1)
        parts = [
            t[frame_positions].view(num_frames, 1, 1, -1).expand(shape),
            h[first_row:first_row + height].view(1, height, 1, -1).expand(shape),
            w[:width].view(1, 1, width, -1).expand(shape),
        ]
        return torch.cat(parts, dim=-1).reshape(1, num_frames * height * width, 1, -1)

    return grid(rope.freqs_cos), grid(rope.freqs_sin)


@dataclass(frozen=True)
class ChunkRotary:
    """The rotary tables a cached chunk hands its engine.

    ``cos``/``sin``: the chunk's own tables, ``[1, chunk_tokens, 1, head_dim]``, at the positions the model layer
    gave it. ``temporal_cos``/``temporal_sin``: the model's temporal rows, ``[rope_max_seq_len, t_dim]``, from which an
    engine that numbers frames at read time builds the tables of other positions (:meth:`for_frames`).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    temporal_cos: torch.Tensor
    temporal_sin: torch.Tensor

    def apply(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` (``[batch, chunk_tokens, heads, head_dim]``) rotated to the chunk's positions."""
        return apply_rotary_emb(hidden_states, self.cos, self.sin)

    def for_frames(self, num_frames: int, frame_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables of temporal positions ``0..num_frames-1`` on the chunk's grid: the temporal rows next to the
        spatial part of the chunk's own tables (the same for every frame)."""
        t_dim = self.temporal_cos.shape[1]
        tables = []
        for temporal, chunk in ((self.temporal_cos, self.cos), (self.temporal_sin, self.sin)):
            rows = temporal[:num_frames].to(chunk.device, chunk.dtype)
            spatial = chunk[0, :frame_tokens, 0, t_dim:]
            shape = (num_frames, frame_tokens, -1)
            table = torch.cat([rows[:, None].expand(shape), spatial[None].expand(shape)], dim=-1)
            tables.append(table.reshape(1, num_frames * frame_tokens, 1, -1))
        return tables[0], tables[1]
