"""The transformer-level hook: each forward under a context is validated, described, run and committed.

``causal_kv`` (a diffusers ``ModelHook`` on the transformer, :class:`CausalForwardHook`): under a context it
validates the forward's inputs before any work, builds the :class:`~.forward_pass.ForwardPass` (with the engines'
:class:`~diffusers_causal_kv.kv_cache.PassInfo`), publishes it to the attention code, and commits what a
``store_kv=True`` forward staged once the forward returns. A forward that raises commits nothing. Without a context
of its own, the transformer runs the stock forward with stock attention.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from diffusers.hooks import ModelHook

from ..ambient import current_context, forward_gatherer, nothing_published, publishing
from ..kv_cache import PassInfo
from ..sharding import row_split
from .checkpointing import route_checkpointing
from .forward_pass import ForwardPass, conditioning_fingerprint
from .gather import GatheredForward
from .topology import projection_state, topology
from .validation import (
    check_forward_inputs,
    check_rope_range,
    check_split_forward,
    check_tag_batch,
    check_tag_positions,
    chunk_rope_start,
    sequence_mask,
)

HOOK_NAME = "causal_kv"

# diffusers hooks (enable_cache, layer skip) that may return cached or predicted outputs instead of running a block or
# an attention module: a store_kv=True forward under them would stage K/V for only some blocks.
BLOCK_SKIPPING_HOOKS = frozenset({
    "fbc_leader_block_hook", "fbc_block_hook", "mag_cache_leader_block_hook", "mag_cache_block_hook",
    "sea_cache_leader_block", "sea_cache_block", "pyramid_attention_broadcast", "faster_cache_block",
    "taylorseer_cache", "layer_skip_hook",
})


class CausalForwardHook(ModelHook):
    """Validates, runs and commits each forward of the transformer under its context."""

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._signature = inspect.signature(module.forward)
        self._module = weakref.ref(module)
        return module

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        # copy.deepcopy copies the hook registry but not the closure of the forward diffusers installed, so a copy's
        # forward runs the original's hook chain, weights and cache: refuse it until the copy's hooks are rebuilt.
        if module is not self._module():
            raise RuntimeError(
                f"this {type(module).__name__} is a copy (copy.deepcopy) of a transformer with the causal KV hooks, "
                "and diffusers' hooks of a copy still run the original's forward and weights; open a CausalContext "
                "on the copy once (it reinstalls the copy's own hooks) or call uninstall_causal_kv(copy) before "
                "using it."
            )
        return args, kwargs

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        context = current_context(module)
        if context is None:
            if nothing_published():  # the common case: skip the publishing, a measurable cost on small models
                return self.fn_ref.original_forward(*args, **kwargs)
            with publishing(None):
                return self.fn_ref.original_forward(*args, **kwargs)
        if context.store_kv:
            _refuse_block_skipping_hooks(module)
        inputs = self._signature.bind(*args, **kwargs).arguments
        p = build_forward_pass(module, context, inputs)
        route_checkpointing(module)
        gatherer = forward_gatherer()
        if gatherer is None:
            with p.running():
                output = self.fn_ref.original_forward(*args, **kwargs)
        else:  # validated here, in the caller's thread; maybe run in one batch with other sessions' forwards
            output = gatherer(GatheredForward(module, inputs, p, self.fn_ref.original_forward))
        p.commit()
        return output


def build_forward_pass(transformer: torch.nn.Module, context, inputs: dict) -> ForwardPass:
    """Validate a forward's inputs against the model and the engines (before any work) and describe it."""
    batch, num_frames, grid_h, grid_w = check_forward_inputs(transformer, inputs)
    split = row_split(transformer)
    if split is not None:
        check_split_forward(context.mode, inputs)
    # Under context parallelism each rank runs (and caches) its rows of every frame.
    frame_tokens = grid_h * grid_w // (1 if split is None else split.degree)
    # The RoPE hook takes them again while an offloading hook has rope's buffers loaded (ForwardPass.temporal_rope).
    rope = transformer.rope
    temporal_rope = (rope.freqs_cos[:, :rope.t_dim], rope.freqs_sin[:, :rope.t_dim])
    if context.mode != "cache":  # mask modes never touch the cache
        mask = sequence_mask(context, num_frames, frame_tokens)
        # Teacher forcing: the clean and the noisy half both sit at positions start_frame, start_frame + 1, ...
        span = num_frames // 2 if context.mode == "teacher_forcing" else num_frames
        check_rope_range(transformer, context.start_frame, span)
        positions = (context.start_frame + torch.arange(span)).repeat(num_frames // span)
        return ForwardPass(context.cache_engines, positions, mask=mask, temporal_rope=temporal_rope)
    device = inputs["hidden_states"].device
    # Under autocast the projections, and so the cached K/V, take the autocast dtype.
    autocast = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else inputs["hidden_states"].dtype
    lora_scale = (inputs.get("attention_kwargs") or {}).get("scale", 1.0)
    tags = context.cache_tags
    rows = check_tag_batch(tags, batch)
    conditioning = (inputs.get("encoder_hidden_states"), inputs.get("encoder_hidden_states_image"))
    infos = [PassInfo(
        cache_tag=tag, start_frame=context.start_frame, chunk_frames=num_frames,
        frame_tokens=frame_tokens, batch_size=rows, dtype=dtype, device=device,
        grad_enabled=torch.is_grad_enabled(), store_kv=context.store_kv,
        conditioning=conditioning_fingerprint(conditioning, None if len(tags) == 1 else (i * rows, (i + 1) * rows)),
        weights=projection_state(transformer, lora_scale),
    ) for i, tag in enumerate(tags)]
    for info in infos:
        for engine in context.cache_engines.values():
            engine.check_pass(info)
    # Positions last, so that a start_frame that does not continue the cache is reported as that.
    firsts = {tag: chunk_rope_start(transformer, context.cache_engines, tag, context.start_frame, num_frames)
              for tag in tags}
    first = check_tag_positions(firsts)
    passes = [ForwardPass(context.cache_engines, first + torch.arange(num_frames), info=info,
                          temporal_rope=temporal_rope, group=None if split is None else split.group) for info in infos]
    if len(passes) == 1:
        return passes[0]
    return ForwardPass(context.cache_engines, passes[0].positions, tag_passes=passes, temporal_rope=temporal_rope,
                       group=passes[0].group)


def _refuse_block_skipping_hooks(transformer: torch.nn.Module) -> None:
    for branch, blocks in topology(transformer).branches.items():
        prefix = "blocks" if branch == "main" else "vace_blocks"
        for name, submodule in blocks.named_modules(prefix=prefix):
            registry = getattr(submodule, "_diffusers_hook", None)
            skipping = sorted(BLOCK_SKIPPING_HOOKS.intersection(getattr(registry, "hooks", ())))
            if skipping:
                raise RuntimeError(
                    f"store_kv=True forward refused: {skipping} on {name} may skip blocks or attention, so the cache "
                    "would be committed for only some blocks. Run commit passes without it: "
                    "transformer.disable_cache() before the store_kv=True forward, enable_cache(config) after."
                )
