"""The model layer: engine branches on the transformer, installation, and the transformer-level hook.

``transformer.kv_cache_engines`` maps branch names to engines: ``"main"`` owns ``transformer.blocks[*]`` and
``"vace"`` (VACE only) owns ``transformer.vace_blocks[*]``, with block indices local to the branch. Installation
(done when the first :class:`~diffusers_causal_kv.CausalContext` opens, after
``transformer.set_attn_processor(CausalWanAttnProcessor())``) creates the missing engines, registers each
attention module with the engine of its branch and adds two named diffusers hooks:

* ``causal_kv`` on the transformer (:class:`CausalForwardHook`): under a context it validates the forward's inputs
  before any work, builds the :class:`~diffusers_causal_kv.context.ForwardPass`, publishes it to the processors,
  and commits what a ``store_kv=True`` forward staged once the forward returns;
* ``causal_kv_rope_positions`` on ``transformer.rope`` (:mod:`diffusers_causal_kv.positions`).

Hook order with diffusers' own hooks: a hook registered later wraps the ones registered before it. Ours are
registered when the first context opens, so they wrap hooks applied earlier and are wrapped by hooks applied later.
Cache hooks (``transformer.enable_cache(...)``) live on the blocks and attention modules, inside our transformer
hook, so either order works; denoising forwards run under them with the approximation they imply, but a
``store_kv=True`` forward is refused before any work while a hook that may skip blocks or attention
(:data:`BLOCK_SKIPPING_HOOKS`) is registered, because it would commit a partial cache. Group offloading works in
either order at block level; at leaf level it also hooks ``transformer.rope`` to onload its buffers, and that hook
must wrap ours (our RoPE hook computes the tables without calling the forward it wraps), so leaf-level offloading
must be enabled after the first context opened (refused otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.utils.checkpoint
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from .context import ForwardPass, get_current_context, no_running_pass, running_pass
from .kv_cache import BaseKVCacheEngine, KVCacheEngine
from .masks import CausalMask, block_causal_mask, teacher_forcing_mask
from .positions import ROPE_HOOK_NAME, TemporalRoPEOffsetHook
from .processors import WAN_TEXT_CONTEXT_LENGTH, CausalWanAttnProcessor, publish_to_compiled_code

HOOK_NAME = "causal_kv"

# diffusers hooks (enable_cache, layer skip) that may return cached or predicted outputs instead of running a block or
# an attention module: a store_kv=True forward under them would stage K/V for only some blocks.
BLOCK_SKIPPING_HOOKS = frozenset({
    "fbc_leader_block_hook", "fbc_block_hook", "mag_cache_leader_block_hook", "mag_cache_block_hook",
    "sea_cache_leader_block", "sea_cache_block", "pyramid_attention_broadcast", "faster_cache_block",
    "taylorseer_cache", "layer_skip_hook",
})


def branch_blocks(transformer: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    """The block lists each engine branch owns."""
    branches = {"main": transformer.blocks}
    if getattr(transformer, "vace_blocks", None) is not None:
        branches["vace"] = transformer.vace_blocks
    return branches


def _attention_modules(block: torch.nn.Module) -> list[torch.nn.Module]:
    return [block.attn1, block.attn2]


# The submodules of a WanAttention that compute the K/V an engine caches (unfused, fused and I2V image paths).
_KV_SUBMODULES = ("to_k", "to_v", "norm_k", "to_kv", "to_qkv", "add_k_proj", "add_v_proj", "to_added_kv",
                  "norm_added_k")


def projection_state(transformer: torch.nn.Module) -> tuple:
    """The state of everything that computes cached K/V, cheap enough to take on every cached forward.

    In-place updates (optimizer steps, ``param.copy_()`` under ``no_grad``) bump a parameter's ``_version``;
    PEFT LoRA injection swaps the submodule, ``set_adapters`` changes its active adapters and scaling,
    ``fuse_lora``/``unfuse_lora`` its merged adapters. Writes through ``param.data`` bypass version counters and
    are not seen.
    """
    state = []
    for attn in _all_attention(transformer):
        for name in _KV_SUBMODULES:
            module = getattr(attn, name, None)
            if module is None:
                continue
            state.append((name, id(module), *_adapter_state(module)))
            state.extend((id(param), param._version) for param in module.parameters())
    return tuple(state)


def _adapter_state(module: torch.nn.Module) -> tuple:
    scaling = getattr(module, "scaling", None)
    return (
        tuple(getattr(module, "active_adapters", ()) or ()),
        tuple(getattr(module, "merged_adapters", ()) or ()),
        tuple(sorted(scaling.items())) if isinstance(scaling, dict) else (),
        bool(getattr(module, "disable_adapters", False)),
    )


def _all_attention(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    return [attn for blocks in branch_blocks(transformer).values() for block in blocks
            for attn in _attention_modules(block)]


def _causal_processors_installed(transformer: torch.nn.Module) -> list[bool]:
    return [isinstance(attn.processor, CausalWanAttnProcessor) for attn in _all_attention(transformer)]


def prepare_transformer(
    transformer: torch.nn.Module, cache_engines: dict[str, BaseKVCacheEngine] | None = None
) -> dict[str, BaseKVCacheEngine]:
    """Complete installation and return the engine map a context uses (validated and registered)."""
    installed = _causal_processors_installed(transformer)
    if not any(installed):
        raise RuntimeError(
            f"{type(transformer).__name__} has no CausalWanAttnProcessor installed; call "
            "transformer.set_attn_processor(CausalWanAttnProcessor()) before opening a CausalContext."
        )
    if not all(installed):
        raise RuntimeError(
            f"{installed.count(False)} of {len(installed)} attention modules of {type(transformer).__name__} do not "
            "use CausalWanAttnProcessor, so their blocks would ignore the cache; install it on all of them with "
            "transformer.set_attn_processor(CausalWanAttnProcessor())."
        )
    if any(getattr(attn.processor, "_parallel_config", None) is not None for attn in _all_attention(transformer)):
        raise NotImplementedError(
            "context parallelism (transformer.enable_parallelism) shards the sequence across devices, which the causal "
            "KV cache does not support yet; disable it for causal rollouts."
        )
    if transformer.config.patch_size[0] != 1:
        raise ValueError(
            f"patch_size={tuple(transformer.config.patch_size)} patches {transformer.config.patch_size[0]} latent "
            "frames together; the causal cache counts latent frames one by one and needs a temporal patch size of 1 "
            "(every Wan checkpoint uses (1, 2, 2))."
        )
    branches = branch_blocks(transformer)
    defaults = getattr(transformer, "kv_cache_engines", None)
    if defaults is None:
        defaults = transformer.kv_cache_engines = {}
    if not isinstance(defaults, dict) or not set(defaults) <= set(branches):
        got = sorted(defaults) if isinstance(defaults, dict) else type(defaults).__name__
        example = ", ".join(f"{b!r}: KVCacheEngine()" for b in branches)
        raise ValueError(
            f"transformer.kv_cache_engines must be a dict from branch names {sorted(branches)} to engines, got "
            f"{got}; e.g. transformer.kv_cache_engines = {{{example}}}."
        )
    for branch in branches:
        defaults.setdefault(branch, KVCacheEngine())
    # The transformer's own map is always complete and registered; a per-session map is validated in full first.
    maps = [defaults] if cache_engines is None else [defaults, cache_engines]
    for engines in maps:
        _check_engine_map(engines, branches)
    for engines in maps:
        for branch, blocks in branches.items():
            for block_idx, block in enumerate(blocks):
                for attn in _attention_modules(block):
                    engines[branch].register_module(attn, block_idx)
    _install_hooks(transformer)
    return maps[-1]


def _check_engine_map(cache_engines: dict, branches: dict) -> None:
    if not isinstance(cache_engines, dict) or set(cache_engines) != set(branches):
        got = sorted(cache_engines) if isinstance(cache_engines, dict) else type(cache_engines).__name__
        raise ValueError(
            f"cache_engines must map exactly the branches {sorted(branches)} to engines, got {got}; e.g. "
            + "{" + ", ".join(f"{b!r}: KVCacheEngine()" for b in branches) + "}."
        )
    for branch, engine in cache_engines.items():
        if not isinstance(engine, BaseKVCacheEngine):
            raise TypeError(
                f"cache_engines[{branch!r}] is a {type(engine).__name__}, not a KV-cache engine; use "
                "KVCacheEngine() or another BaseKVCacheEngine subclass."
            )
    if len({id(e) for e in cache_engines.values()}) != len(cache_engines):
        raise ValueError(
            "One engine object serves several branches of cache_engines; block indices are local to a branch, "
            "so each branch needs its own engine instance."
        )
    for branch, engine in cache_engines.items():
        foreign = [
            other for other, blocks in branches.items() if other != branch
            for block in blocks for attn in _attention_modules(block) if engine.owns(attn)
        ]
        if foreign:
            raise ValueError(
                f"The engine of branch {branch!r} already registered modules of branch {foreign[0]!r}; give each "
                "branch its own engine."
            )


def _install_hooks(transformer: torch.nn.Module) -> None:
    rope_hooks = getattr(getattr(transformer.rope, "_diffusers_hook", None), "hooks", {})
    if ROPE_HOOK_NAME not in rope_hooks and rope_hooks:
        # Our RoPE hook computes the tables itself, so registered outside another rope hook (leaf-level group
        # offloading onloads rope's buffers in one) it would read offloaded buffers.
        raise RuntimeError(
            f"transformer.rope already has the diffusers hooks {sorted(rope_hooks)} (e.g. leaf-level group "
            "offloading), which the causal KV RoPE hook cannot run inside of; open a first CausalContext (it "
            "installs the plugin's hooks) before transformer.enable_group_offload(...), or use "
            "offload_type='block_level'."
        )
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(HOOK_NAME) is None:
        registry.register_hook(CausalForwardHook(), HOOK_NAME)
    rope_registry = HookRegistry.check_if_exists_or_initialize(transformer.rope)
    if rope_registry.get_hook(ROPE_HOOK_NAME) is None:
        rope_registry.register_hook(TemporalRoPEOffsetHook(), ROPE_HOOK_NAME)


def clear_caches(transformer: torch.nn.Module) -> None:
    """Clear every engine on ``transformer.kv_cache_engines`` (call at the start of each rollout)."""
    if not any(_causal_processors_installed(transformer)):
        raise RuntimeError(
            f"{type(transformer).__name__} has no CausalWanAttnProcessor installed, so it has no KV cache to clear; "
            "call transformer.set_attn_processor(CausalWanAttnProcessor()) first."
        )
    for engine in getattr(transformer, "kv_cache_engines", {}).values():
        engine.clear()


def uninstall_causal_kv(transformer: torch.nn.Module) -> None:
    """Restore the stock ``WanAttnProcessor`` everywhere, remove the hooks and drop ``kv_cache_engines``."""
    if get_current_context(transformer) is not None:
        raise RuntimeError("uninstall_causal_kv() called inside a CausalContext of this transformer; close it first.")
    for attn in _all_attention(transformer):
        if isinstance(attn.processor, CausalWanAttnProcessor):
            stock = WanAttnProcessor()
            stock._attention_backend = attn.processor._attention_backend
            attn.set_processor(stock)
    for module, name in ((transformer, HOOK_NAME), (transformer.rope, ROPE_HOOK_NAME)):
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(name) is not None:
            registry.remove_hook(name, recurse=False)
    if isinstance(getattr(transformer, "_gradient_checkpointing_func", None), PassAwareCheckpoint):
        transformer._gradient_checkpointing_func = transformer._gradient_checkpointing_func.inner
    if hasattr(transformer, "kv_cache_engines"):
        del transformer.kv_cache_engines


class CausalForwardHook(ModelHook):
    """Validates, runs and commits each forward of the transformer under its :class:`CausalContext`."""

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._signature = inspect.signature(module.forward)
        return module

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        ctx = get_current_context(module)
        if ctx is None:
            with no_running_pass(), publish_to_compiled_code(None):
                return self.fn_ref.original_forward(*args, **kwargs)
        if ctx.store_kv:
            _refuse_block_skipping_hooks(module)
        inputs = self._signature.bind(*args, **kwargs).arguments
        p = build_forward_pass(module, ctx, inputs)
        _route_checkpointing(module)
        with p.running(), publish_to_compiled_code(p):
            output = self.fn_ref.original_forward(*args, **kwargs)
        p.commit()
        return output


def _refuse_block_skipping_hooks(transformer: torch.nn.Module) -> None:
    for branch, blocks in branch_blocks(transformer).items():
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


class PassAwareCheckpoint:
    """The transformer's ``_gradient_checkpointing_func`` once a forward under a context checkpoints its blocks.

    Checkpointed blocks are recomputed during ``backward()``, after the context has exited and maybe after more
    chunks were committed. This checkpoint reads the running pass when the block runs (so concurrent forwards in
    other threads or sessions each get their own) and its ``context_fn`` re-enters that pass for the
    recomputation, whose remembered prefixes give exactly the K/V the forward saw. Without a running pass it
    calls the function it replaced. It is installed once and never swapped back, because diffusers rebuilds the
    function on every ``enable_gradient_checkpointing()`` call; the hook re-installs it then.
    """

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, block: torch.nn.Module, *args):
        p = running_pass()
        if p is None:
            return self.inner(block, *args)
        return torch.utils.checkpoint.checkpoint(
            block.__call__, *args, use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), _recomputing(p)),
        )


def _route_checkpointing(module: torch.nn.Module) -> None:
    if getattr(module, "gradient_checkpointing", False) and not isinstance(
        module._gradient_checkpointing_func, PassAwareCheckpoint
    ):
        module._gradient_checkpointing_func = PassAwareCheckpoint(module._gradient_checkpointing_func)


@contextlib.contextmanager
def _recomputing(p: ForwardPass):
    """Re-publish ``p`` for a checkpoint recomputation, to eager and compiled attention code alike."""
    with p.running(recomputing=True), publish_to_compiled_code(p):
        yield


def build_forward_pass(transformer: torch.nn.Module, ctx, inputs: dict) -> ForwardPass:
    """Validate a forward's inputs against the model and the engines (before any work) and describe it as a
    ForwardPass."""
    batch, num_frames, grid_h, grid_w = check_forward_inputs(transformer, inputs)
    frame_tokens = grid_h * grid_w
    mask = None if ctx.mode == "cache" else _sequence_mask(ctx, num_frames, frame_tokens)
    hidden_states = inputs["hidden_states"]
    p = ForwardPass(
        context=ctx,
        num_frames=num_frames,
        frame_tokens=frame_tokens,
        batch_size=batch,
        dtype=hidden_states.dtype,
        device=hidden_states.device,
        conditioning=(inputs.get("encoder_hidden_states"), inputs.get("encoder_hidden_states_image")),
        mask=mask,
        weights_state=functools.partial(projection_state, transformer),
    )
    if mask is None:  # mask modes never touch the cache
        for engine in p.engines:
            engine.check_pass(p)
    # Positions last, so that a start_frame that does not continue the cache is reported as that.
    # Teacher forcing: the clean and the noisy half both sit at positions start_frame, start_frame + 1, ...
    span = num_frames // 2 if ctx.mode == "teacher_forcing" else num_frames
    first = ctx.start_frame if mask is not None else _rope_start_frame(ctx, num_frames)
    _check_rope_range(transformer, first, span)
    p.positions = (first + torch.arange(span)).repeat(num_frames // span)
    return p


def check_forward_inputs(transformer: torch.nn.Module, inputs: dict) -> tuple[int, int, int, int]:
    """Check a forward's inputs against the model alone (no context, no engine): latent shape, timestep,
    conditioning, VACE control. Returns ``(batch, post-patch frames, grid height, grid width)``. The rollout helpers
    also call it before clearing the caches."""
    hidden_states = inputs.get("hidden_states")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 5:
        raise ValueError(
            "hidden_states must be a [batch, channels, frames, height, width] latent tensor under a CausalContext, "
            f"got {getattr(hidden_states, 'shape', type(hidden_states).__name__)}."
        )
    batch, _, frames, height, width = hidden_states.shape
    patch = tuple(transformer.config.patch_size)
    for name, size, step in zip(("frames", "height", "width"), (frames, height, width), patch):
        if size % step:
            raise ValueError(
                f"latent {name} {size} is not divisible by the patch size {step} (patch_size={patch}); "
                f"pad or crop the latents to a multiple of {step}."
            )
    num_frames, grid_h, grid_w = frames // patch[0], height // patch[1], width // patch[2]
    max_len = transformer.rope.max_seq_len
    if max(grid_h, grid_w) > max_len:
        raise ValueError(
            f"post-patch grid {grid_h}x{grid_w} exceeds rope_max_seq_len={max_len}; use smaller latents or a model "
            "with a larger rope_max_seq_len."
        )
    is_vace = "vace" in branch_blocks(transformer)
    _check_timestep(inputs.get("timestep"), batch, num_frames * grid_h * grid_w, per_token=not is_vace)
    _check_conditioning(transformer, inputs.get("encoder_hidden_states"), inputs.get("encoder_hidden_states_image"),
                        batch)
    if is_vace:
        _check_control(transformer, hidden_states, inputs.get("control_hidden_states"),
                       inputs.get("control_hidden_states_scale"))
    return batch, num_frames, grid_h, grid_w


def _sequence_mask(ctx, num_frames: int, frame_tokens: int) -> CausalMask:
    """The mask of a mask-mode forward over ``num_frames`` post-patch frames: the context's, or built for it."""
    if ctx.mode == "teacher_forcing" and num_frames % 2:
        raise ValueError(
            f"mode='teacher_forcing' takes [clean context | noisy frames] with halves of equal length, but the "
            f"input has {num_frames} latent frames; concatenate clean and noisy latents of the same length."
        )
    if ctx.mask is not None:
        if (ctx.mask.num_frames, ctx.mask.frame_tokens) != (num_frames, frame_tokens):
            raise ValueError(
                f"{ctx.mask!r} covers {ctx.mask.num_frames} frames of {ctx.mask.frame_tokens} tokens but this "
                f"forward has {num_frames} frames of {frame_tokens} tokens; build the mask for this sequence."
            )
        return ctx.mask
    build = block_causal_mask if ctx.mode == "block_causal" else teacher_forcing_mask
    half = num_frames // 2 if ctx.mode == "teacher_forcing" else num_frames
    return build(half, ctx.chunk_frames, frame_tokens, window_frames=ctx.window_frames, sink_frames=ctx.sink_frames)


def _check_timestep(timestep, batch: int, tokens: int, per_token: bool = True) -> None:
    if not isinstance(timestep, torch.Tensor):
        raise TypeError(
            f"timestep must be a tensor of shape [batch] or [batch, tokens], got {type(timestep).__name__}."
        )
    if timestep.ndim == 1 and timestep.shape[0] in (1, batch):
        return
    if per_token and timestep.ndim == 2 and timestep.shape[0] in (1, batch) and timestep.shape[1] == tokens:
        return
    if not per_token:
        raise ValueError(
            f"timestep has shape {tuple(timestep.shape)}; the VACE transformer takes one timestep per sample, "
            f"shape [{batch}]: denoise each chunk at a uniform timestep."
        )
    raise ValueError(
        f"timestep has shape {tuple(timestep.shape)}; a chunk of {tokens} tokens with batch {batch} takes shape "
        f"[{batch}] (one timestep per sample) or [{batch}, {tokens}] (per-token timesteps for this chunk only)."
    )


def _rope_start_frame(ctx, num_frames: int) -> int:
    """The chunk's first temporal RoPE position, as the engines place it (an engine that re-indexes positions
    inside a window is not bounded by the absolute frame index)."""
    starts = {e.rope_start_frame(ctx.cache_tag, ctx.start_frame, num_frames) for e in ctx.cache_engines.values()}
    if len(starts) > 1:
        raise ValueError(
            f"the engines of this transformer place the chunk at different RoPE positions {sorted(starts)}, but "
            "one rotary embedding serves every branch; give every branch the same kind of engine and positions."
        )
    return starts.pop()


def _check_rope_range(transformer, start_frame: int, num_frames: int) -> None:
    max_len = transformer.rope.max_seq_len
    if start_frame + num_frames > max_len:
        raise ValueError(
            f"chunk covers latent frames {start_frame}..{start_frame + num_frames - 1} but the RoPE table has "
            f"{max_len} positions (rope_max_seq_len); shorten the rollout, build the model with a larger "
            "rope_max_seq_len, or use an engine that re-indexes positions."
        )


def _check_conditioning(transformer, text, image, batch: int) -> None:
    text_dim = transformer.config.text_dim
    if not isinstance(text, torch.Tensor) or text.ndim != 3 or text.shape[2] != text_dim:
        raise ValueError(
            f"encoder_hidden_states must be a [batch, tokens, {text_dim}] tensor (the text encoder's output) under a "
            f"CausalContext, got {tuple(getattr(text, 'shape', ())) or type(text).__name__}."
        )
    if text.shape[0] not in (1, batch):
        raise ValueError(f"encoder_hidden_states has batch {text.shape[0]} but the latents have batch {batch}.")
    is_i2v = transformer.blocks[0].attn2.add_k_proj is not None
    if not is_i2v and image is not None:
        raise ValueError(
            "encoder_hidden_states_image was given but this transformer has no image projections (not an I2V "
            "model); drop the image embeddings."
        )
    if not is_i2v:
        return
    if image is None:
        raise ValueError(
            "this is an image-to-video Wan transformer (added K/V projections): pass encoder_hidden_states_image "
            "(the image encoder's embeddings) to every forward."
        )
    image_dim = transformer.config.image_dim
    if not isinstance(image, torch.Tensor) or image.ndim != 3 or image.shape[0] not in (1, batch) \
            or image.shape[2] != image_dim:
        raise ValueError(
            f"encoder_hidden_states_image must be a [batch, tokens, {image_dim}] tensor (the image encoder's output) "
            f"with batch {batch} (or 1), got {tuple(getattr(image, 'shape', ())) or type(image).__name__}."
        )
    if text.shape[1] != WAN_TEXT_CONTEXT_LENGTH:
        raise ValueError(
            f"Wan I2V splits image tokens off assuming {WAN_TEXT_CONTEXT_LENGTH} text tokens, but "
            f"encoder_hidden_states has {text.shape[1]}; pad the prompt embeddings to {WAN_TEXT_CONTEXT_LENGTH}."
        )


def _check_control(transformer, hidden_states: torch.Tensor, control, scale) -> None:
    """VACE control latents must cover exactly this chunk (stock code zero-pads short ones silently)."""
    batch, _, frames, height, width = hidden_states.shape
    channels = transformer.config.vace_in_channels
    if control is None:
        raise ValueError(
            "this is a VACE transformer: pass control_hidden_states, the chunk's slice of the control latents "
            f"([batch, {channels}, frames, height, width], the same frames as hidden_states)."
        )
    expected = (batch, channels, frames, height, width)
    if not isinstance(control, torch.Tensor) or tuple(control.shape) != expected:
        raise ValueError(
            f"control_hidden_states has shape {tuple(getattr(control, 'shape', ()))} but this chunk needs "
            f"{expected}: slice the control latents to the chunk's frames, "
            f"control[:, :, start_frame:start_frame + {frames}]."
        )
    layers = len(transformer.config.vace_layers)
    if scale is not None and (not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (layers,)):
        raise ValueError(
            f"control_hidden_states_scale has shape {tuple(getattr(scale, 'shape', ()))} but the model has "
            f"{layers} VACE layers {list(transformer.config.vace_layers)}: pass a tensor of shape [{layers}], "
            "one scale per VACE layer, or None for all ones."
        )
