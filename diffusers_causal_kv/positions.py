"""Temporal RoPE positions for chunks: a diffusers hook on ``transformer.rope``.

The stock ``WanRotaryPosEmbed`` numbers the frames of its input ``0..F-1``. Under a running forward pass the hook
gives them the pass's ``positions`` instead (from ``start_frame`` on, or where an engine that re-indexes positions
places the chunk; in teacher forcing, the same positions for the clean and the noisy half), through the rotary-math
leaf. Outside a pass it calls the stock forward untouched.

Under ``causal_cp_plan`` the transformer's inputs are split before ``rope`` runs, so ``rope`` sees this rank's rows
of every frame: the hook places them at the rank's own rows of the grid, in a pass or not (it sits inside the split
whatever the order of ``enable_parallelism`` and the first context, as the split is the transformer's own input).
"""

from __future__ import annotations

import weakref

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .ambient import running_pass
from .rotary import rope_for_frames
from .sharding import row_split

ROPE_HOOK_NAME = "causal_kv_rope_positions"


class TemporalRoPEOffsetHook(ModelHook):
    """Gives ``transformer.rope`` the running pass's temporal positions (and a rank's rows of the grid)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self._transformer = weakref.ref(transformer)

    def new_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor):
        """The RoPE tables of ``hidden_states``: the stock ones outside a running pass, else those of the pass's
        ``positions`` per latent frame (see the module docstring)."""
        p = running_pass()
        transformer = self._transformer()
        split = None if transformer is None else row_split(transformer)
        if p is None and split is None:
            return self.fn_ref.original_forward(hidden_states)
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = module.patch_size
        rows = height // p_h
        positions = torch.arange(frames // p_t) if p is None else p.positions
        if p is not None:
            # Here, and not when the pass is built: an offloading hook around this one has rope's buffers loaded now
            # and swaps in empty ones after (to disk); these views keep the loaded storage.
            p.take_temporal_rope(module.freqs_cos[:, :module.t_dim], module.freqs_sin[:, :module.t_dim])
        first_row = 0 if split is None else split.rank * rows
        # non_blocking: a blocking copy from host memory waits for the device to finish all the work queued so far,
        # once per forward; from pageable memory the copy is staged before the call returns, so this is safe.
        positions = positions.to(module.freqs_cos.device, non_blocking=True)
        return rope_for_frames(module, positions, rows, width // p_w, first_row)


def install_rope_hook(transformer: torch.nn.Module) -> None:
    """Register the hook on ``transformer.rope`` (once), as its innermost hook, whatever was registered before.

    The hook computes the tables from ``rope``'s buffers without calling the forward it wraps, so every other hook on
    ``rope`` must wrap it: leaf-level group offloading onloads those buffers in a hook of its own (and offloads them
    after), whichever of ``enable_group_offload(...)`` and the first context came first. A diffusers ``HookRegistry``
    only appends (the hook registered last runs outermost), so hooks registered before ours are taken off, outermost
    first (each removal restores the forward it wrapped), and registered again around ours, in their order, as the
    same objects (their state and groups kept; a group-offloading hook's re-initialisation offloads its group again,
    which is a no-op for a group that is offloaded).
    """
    registry = HookRegistry.check_if_exists_or_initialize(transformer.rope)
    order = list(registry._hook_order)
    if order[:1] == [ROPE_HOOK_NAME]:
        return
    hook = registry.get_hook(ROPE_HOOK_NAME) or TemporalRoPEOffsetHook(transformer)
    outer = [(name, registry.hooks[name]) for name in order if name != ROPE_HOOK_NAME]
    for name in reversed(order):
        registry.remove_hook(name, recurse=False)
    registry.register_hook(hook, ROPE_HOOK_NAME)
    for name, other in outer:
        registry.register_hook(other, name)
