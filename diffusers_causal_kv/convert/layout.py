"""Original Wan key layout -> diffusers ``WanTransformer3DModel``: key names and the model config.

Key names are renamed by diffusers' own single-file conversion (``convert_wan_transformer_to_diffusers``), applied to
the names only (a dict mapping each name to itself), so no tensor is touched and the mapping is diffusers', not a
copy of it. The config is inferred from tensor shapes alone, never looked up on the Hub: every Wan release (and
every causal checkpoint distilled from one) differs only in sizes, which the weights spell out; the attention head
count is the one size they do not (``dim = heads * head_dim``), and every Wan release uses a head dim of 128.

State dicts already in diffusers naming (FastVideo's releases) are read with the same code: the original names the
config is read from are renamed to diffusers' by the same conversion (:func:`diffusers_name`).
"""

from __future__ import annotations

import math
import re

from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

WAN_HEAD_DIM = 128
# The keys the config is read from besides the blocks (whose sizes come from whichever block has them).
REQUIRED_KEYS = ("patch_embedding.weight", "text_embedding.0.weight", "time_embedding.0.weight", "head.head.weight")
# Keys of variants whose conversion needs tensor surgery (Wan-Animate): left unmapped, so they are reported.
UNSUPPORTED_MARKERS = ("face_adapter", "motion_encoder")


def diffusers_name(key: str) -> str:
    """The diffusers name of one original Wan key."""
    return next(iter(convert_wan_transformer_to_diffusers({key: None})))


def is_original_wan_layout(keys) -> bool:
    keys = set(keys)
    return all(key in keys for key in REQUIRED_KEYS) and any(key.startswith("blocks.") for key in keys)


def is_diffusers_layout(keys) -> bool:
    keys = set(keys)
    return all(diffusers_name(key) in keys for key in REQUIRED_KEYS) and any(k.startswith("blocks.") for k in keys)


def diffusers_names(keys) -> tuple[dict[str, str], list[str]]:
    """``(diffusers key -> original key, original keys diffusers' conversion cannot map)``."""
    supported = [key for key in keys if not any(marker in key for marker in UNSUPPORTED_MARKERS)]
    unmapped = [key for key in keys if key not in supported]
    names = convert_wan_transformer_to_diffusers({key: key for key in supported})
    unmapped += sorted(set(supported) - set(names.values()))  # two original names renamed onto one
    return names, unmapped


def infer_config(shape, keys, num_attention_heads: int | None = None, attention_head_dim: int | None = None,
                 diffusers_keys: bool = False) -> dict:
    """The ``WanTransformer3DModel`` config of an original-layout state dict (or, with ``diffusers_keys``, of one in
    diffusers naming), ``shape(key)`` giving tensor shapes.

    Sizes come from the tensors; the head split from ``num_attention_heads`` / ``attention_head_dim`` (either one,
    or neither for Wan's head dim of 128); everything else is Wan's default (``eps``, ``rope_max_seq_len``). Block
    sizes are read from the first block that has the tensor, so that a missing one is reported as a missing key."""
    keys = set(keys)
    name_of = diffusers_name if diffusers_keys else str

    def shape_of(original: str) -> tuple[int, ...]:
        return shape(name_of(original))

    def block_shape(name: str) -> tuple[int, ...] | None:
        suffix = name_of(f"blocks.0.{name}").removeprefix("blocks.0.")
        key = next((k for k in sorted(keys) if re.fullmatch(rf"blocks\.\d+\.{re.escape(suffix)}", k)), None)
        return None if key is None else shape(key)

    def in_a_block(name: str) -> bool:
        return block_shape(name) is not None

    dim, in_channels, *patch = shape_of("patch_embedding.weight")
    heads, head_dim = _head_split(dim, num_attention_heads, attention_head_dim)
    config = dict(
        patch_size=tuple(patch),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=in_channels,
        out_channels=shape_of("head.head.weight")[0] // math.prod(patch),
        text_dim=shape_of("text_embedding.0.weight")[1],
        freq_dim=shape_of("time_embedding.0.weight")[1],
        ffn_dim=(block_shape("ffn.0.weight") or (dim,))[0],  # (no block has it: reported as missing keys)
        num_layers=1 + max(int(m.group(1)) for key in keys if (m := re.match(r"blocks\.(\d+)\.", key))),
        cross_attn_norm=in_a_block("norm3.weight"),
        qk_norm="rms_norm_across_heads" if in_a_block("self_attn.norm_q.weight") else None,
    )
    if name_of("img_emb.proj.0.weight") in keys:  # Wan2.1 I2V: the image embedder and cross-attention K/V projections
        config["image_dim"] = shape_of("img_emb.proj.0.weight")[0]
        config["added_kv_proj_dim"] = (block_shape("cross_attn.k_img.weight") or (None, dim))[1]
    return config


def _head_split(dim: int, heads: int | None, head_dim: int | None) -> tuple[int, int]:
    if heads is None and head_dim is None:
        head_dim = WAN_HEAD_DIM
    if heads is None:
        heads = dim // head_dim if head_dim > 0 and dim % head_dim == 0 else 0
    elif head_dim is None:
        head_dim = dim // heads if heads > 0 and dim % heads == 0 else 0
    if heads <= 0 or head_dim <= 0 or heads * head_dim != dim:
        raise ValueError(
            f"cannot split dim {dim} into num_attention_heads={heads or '?'} x attention_head_dim={head_dim or '?'}; "
            f"pass num_attention_heads (or attention_head_dim) so that heads x head dim = {dim}."
        )
    return heads, head_dim
