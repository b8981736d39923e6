"""Temporal RoPE positions for chunks: a diffusers hook on ``transformer.rope``.

The stock ``WanRotaryPosEmbed`` numbers the frames of its input ``0..F-1``. Under a running forward pass the hook
gives them the pass's ``positions`` instead (from ``start_frame`` on, or where an engine that re-indexes positions
places the chunk; in teacher forcing, the same positions for the clean and the noisy half), through the rotary-math
leaf. Outside a pass it calls the stock forward untouched.
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from .ambient import running_pass
from .rotary import rope_for_frames

ROPE_HOOK_NAME = "causal_kv_rope_positions"


class TemporalRoPEOffsetHook(ModelHook):
    """Gives ``transformer.rope`` the running pass's temporal positions."""

    def new_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor):
        """The RoPE tables of ``hidden_states``: the stock ones outside a running pass, else those of the pass's
        ``positions`` per latent frame (see the module docstring)."""
        p = running_pass()
        if p is None:
            return self.fn_ref.original_forward(hidden_states)
        _, _, _, height, width = hidden_states.shape
        _, p_h, p_w = module.patch_size
        return rope_for_frames(module, p.positions.to(module.freqs_cos.device), height // p_h, width // p_w)
