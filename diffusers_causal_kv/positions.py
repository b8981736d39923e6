"""Temporal RoPE positions for chunks: a diffusers hook on ``transformer.rope``.

The stock ``WanRotaryPosEmbed`` numbers the frames of its input ``0..F-1``. Under a running
:class:`~diffusers_causal_kv.context.ForwardPass` the hook gives them the pass's ``positions`` instead (from
``start_frame`` on; in teacher forcing, the same positions for the clean and the noisy half),
using the rope module's own ``t_dim/h_dim/w_dim`` split and frequency tables (so any head dim works, not only
multiples of 6). Outside a pass it calls the stock forward untouched.
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from .context import running_pass

ROPE_HOOK_NAME = "causal_kv_rope_positions"


def apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding (the same arithmetic as the stock processor, so results are bitwise)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def rope_for_frames(rope: torch.nn.Module, frame_positions: torch.Tensor, height: int, width: int):
    """``(freqs_cos, freqs_sin)`` of shape ``[1, F*height*width, 1, head_dim]`` for temporal positions
    ``frame_positions`` (``[F]``, any integers inside the table) on a post-patch ``height x width`` grid."""
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    num_frames = frame_positions.numel()
    shape = (num_frames, height, width, -1)

    def grid(table: torch.Tensor) -> torch.Tensor:
        t, h, w = table.split(split, dim=1)
        parts = [
            t[frame_positions].view(num_frames, 1, 1, -1).expand(shape),
            h[:height].view(1, height, 1, -1).expand(shape),
            w[:width].view(1, 1, width, -1).expand(shape),
        ]
        return torch.cat(parts, dim=-1).reshape(1, num_frames * height * width, 1, -1)

    return grid(rope.freqs_cos), grid(rope.freqs_sin)


class TemporalRoPEOffsetHook(ModelHook):
    """Gives ``transformer.rope`` the running pass's temporal positions (offset by its ``start_frame``)."""

    def new_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor):
        p = running_pass()
        if p is None:
            return self.fn_ref.original_forward(hidden_states)
        _, _, _, height, width = hidden_states.shape
        _, p_h, p_w = module.patch_size
        return rope_for_frames(module, p.positions.to(module.freqs_cos.device), height // p_h, width // p_w)
