"""Pre-flight checks: the only home of the checks that run before any work, for one forward and for a rollout.

Forward checks compare a forward's inputs with the model alone (:func:`check_forward_inputs`), then with the
engines of its context (each engine's ``check_pass``), then its RoPE positions with the model's table
(:func:`chunk_rope_start`). Rollouts call :func:`check_rollout` (and :func:`check_forward_inputs` on each tag's
first chunk) before they clear or commit anything. Every error names its cause and its fix.
"""

from __future__ import annotations

import torch

from ..kv_cache import BaseKVCacheEngine
from ..masks import CausalMask, block_causal_mask, teacher_forcing_mask
from ..processors import WAN_TEXT_CONTEXT_LENGTH
from ..sharding import check_rows, row_split
from .topology import topology


def check_forward_inputs(transformer: torch.nn.Module, inputs: dict) -> tuple[int, int, int, int]:
    """Check a forward's inputs against the model alone (no context, no engine): latent shape, timestep,
    conditioning, VACE control. Returns ``(batch, post-patch frames, grid height, grid width)``."""
    hidden_states = inputs.get("hidden_states")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 5:
        raise ValueError(
            "hidden_states must be a [batch, channels, frames, height, width] latent tensor under a CausalContext, "
            f"got {getattr(hidden_states, 'shape', type(hidden_states).__name__)}."
        )
    batch, channels, frames, height, width = hidden_states.shape
    if channels != transformer.config.in_channels:
        raise ValueError(
            f"hidden_states has {channels} channels but the model takes in_channels={transformer.config.in_channels}; "
            "pass latents of the model's latent channels (Wan2.1 I2V: the noise concatenated with the condition "
            "latents along channels)."
        )
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
    kind = topology(transformer)
    _check_timestep(inputs.get("timestep"), batch, num_frames * grid_h * grid_w, per_token=not kind.is_vace)
    split = row_split(transformer)
    if split is not None:
        check_rows(split, grid_h, patch[1])
        timestep = inputs.get("timestep")
        if isinstance(timestep, torch.Tensor) and timestep.ndim == 2:
            raise ValueError(
                "per-token timesteps (Wan2.2 TI2V, expand_timesteps=True) cannot be split by causal_cp_plan, which "
                "splits every frame's rows; run TI2V without context parallelism."
            )
    _check_conditioning(transformer, kind.is_i2v, inputs.get("encoder_hidden_states"),
                        inputs.get("encoder_hidden_states_image"), batch)
    if kind.is_vace:
        _check_control(transformer, hidden_states, inputs.get("control_hidden_states"),
                       inputs.get("control_hidden_states_scale"))
    return batch, num_frames, grid_h, grid_w


def check_split_forward(mode: str, inputs: dict) -> None:
    """What a forward under ``causal_cp_plan`` needs beyond its inputs' shapes (checked before any work)."""
    if mode != "cache":
        raise ValueError(
            f"mode={mode!r} attends with a whole-sequence mask, which context parallelism does not split; train "
            "(block_causal / teacher_forcing) without transformer.enable_parallelism, or use the cache mode."
        )
    if inputs.get("return_dict", True):
        raise ValueError(
            "a forward under context parallelism needs return_dict=False: diffusers' split hook on the transformer "
            "refuses its output dataclass after the forward ran; call transformer(..., return_dict=False)[0]."
        )


def check_rollout(transformer: torch.nn.Module, engines: dict[str, BaseKVCacheEngine], first_frame: int,
                  sizes: list[int]) -> None:
    """Fail before a rollout's first chunk if a chunk schedule from ``first_frame`` on cannot run: a schedule an
    engine cannot hold, branches mixing relative and absolute positions, or frames past the RoPE table."""
    for engine in engines.values():
        engine.check_schedule(first_frame, sizes)
    if _reindexing(engines):  # positions inside a window: not bounded by the frame index
        return
    check_rope_range(transformer, first_frame, sum(sizes), rollout=True)


def chunk_rope_start(transformer, engines: dict[str, BaseKVCacheEngine], cache_tag: str, start_frame: int,
                     chunk_frames: int) -> int:
    """The RoPE position of a cached chunk's first frame, as its engines place it, checked against the table."""
    for engine in engines.values():
        engine.check_rope_table(transformer.rope.max_seq_len)
    starts = {engine.rope_start_frame(cache_tag, start_frame, chunk_frames) for engine in engines.values()}
    if len(starts) > 1:
        raise ValueError(
            f"the engines of this transformer place the chunk at different RoPE positions {sorted(starts)}, but "
            "one rotary embedding serves every branch; give every branch the same kind of engine and positions."
        )
    first = starts.pop()
    check_rope_range(transformer, first, chunk_frames)
    return first


def check_tag_batch(tags: tuple[str, ...], batch: int) -> int:
    """Rows per tag of a forward on ``tags`` (one group of rows each); refuses a batch that does not split evenly."""
    if batch % len(tags):
        raise ValueError(
            f"cache_tag={tags!r} splits the batch into {len(tags)} equal groups of rows (one per tag), but the batch "
            f"has {batch} rows; concatenate one equal batch per tag, in the order of the tags."
        )
    return batch // len(tags)


def check_tag_positions(firsts: dict[str, int]) -> int:
    """The one RoPE start of a batch of tags; refuses tags whose engines place the chunk at different positions."""
    starts = set(firsts.values())
    if len(starts) > 1:
        raise ValueError(
            f"the tags of this batch place the chunk at different RoPE positions {firsts}, but one forward has one "
            "rotary table; run the tags as separate forwards (RolloutPlanner(..., cfg_batch=False))."
        )
    return starts.pop()


def check_rope_range(transformer, first: int, num_frames: int, rollout: bool = False) -> None:
    max_len = transformer.rope.max_seq_len
    if first + num_frames <= max_len:
        return
    if rollout:
        raise ValueError(
            f"the rollout covers latent frames {first}..{first + num_frames - 1} but the RoPE table has {max_len} "
            "positions (rope_max_seq_len); generate fewer frames, use a model with a larger rope_max_seq_len, "
            "or a RollingKVCacheEngine(..., positions='relative'), which re-indexes positions."
        )
    raise ValueError(
        f"chunk covers latent frames {first}..{first + num_frames - 1} but the RoPE table has "
        f"{max_len} positions (rope_max_seq_len); shorten the rollout, build the model with a larger "
        "rope_max_seq_len, or use an engine that re-indexes positions."
    )


def _reindexing(engines: dict[str, BaseKVCacheEngine]) -> bool:
    """Whether the engines number positions inside a window; one rotary embedding serves every branch, so they
    must agree."""
    kinds = {engine.reindexes_positions for engine in engines.values()}
    if len(kinds) > 1:
        raise ValueError(
            "the engines of this transformer place the chunk at different RoPE positions (relative and absolute "
            "ones), but one rotary embedding serves every branch; give every branch the same kind of engine and "
            "positions."
        )
    return kinds == {True}


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


def _check_conditioning(transformer, is_i2v: bool, text, image, batch: int) -> None:
    text_dim = transformer.config.text_dim
    if not isinstance(text, torch.Tensor) or text.ndim != 3 or text.shape[2] != text_dim:
        raise ValueError(
            f"encoder_hidden_states must be a [batch, tokens, {text_dim}] tensor (the text encoder's output) under a "
            f"CausalContext, got {tuple(getattr(text, 'shape', ())) or type(text).__name__}."
        )
    if text.shape[0] not in (1, batch):
        raise ValueError(f"encoder_hidden_states has batch {text.shape[0]} but the latents have batch {batch}.")
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
    if image.shape[0] != text.shape[0]:
        raise ValueError(
            f"encoder_hidden_states_image has batch {image.shape[0]} but encoder_hidden_states has batch "
            f"{text.shape[0]}; Wan I2V concatenates them per sample, so give both the same batch."
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


def sequence_mask(context, num_frames: int, frame_tokens: int) -> CausalMask:
    """The mask of a mask-mode forward over ``num_frames`` post-patch frames: the context's, or built for it."""
    if context.mode == "teacher_forcing" and num_frames % 2:
        raise ValueError(
            f"mode='teacher_forcing' takes [clean context | noisy frames] with halves of equal length, but the "
            f"input has {num_frames} latent frames; concatenate clean and noisy latents of the same length."
        )
    if context.mask is not None:
        if (context.mask.num_frames, context.mask.frame_tokens) != (num_frames, frame_tokens):
            raise ValueError(
                f"{context.mask!r} covers {context.mask.num_frames} frames of {context.mask.frame_tokens} tokens but "
                f"this forward has {num_frames} frames of {frame_tokens} tokens; build the mask for this sequence."
            )
        return context.mask
    build = block_causal_mask if context.mode == "block_causal" else teacher_forcing_mask
    half = num_frames // 2 if context.mode == "teacher_forcing" else num_frames
    return build(half, context.chunk_frames, frame_tokens, window_frames=context.window_frames,
                 sink_frames=context.sink_frames)
