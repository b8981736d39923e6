""":func:`convert_checkpoint`: a published causal Wan checkpoint -> a diffusers ``WanTransformer3DModel`` folder.

The steps, each refusing what it cannot do with an error that names the file and the keys:

1. read the file lazily (:mod:`.reading`) and tell its layout: a wrapper ``.pt`` of ``generator``/``generator_ema``
   entries, or one flat state dict;
2. pick the peer (``format``, or from the layout and the released file's name) and, in a wrapper, the entry the
   peer's inference loads (``ema``);
3. strip the training wrappers' prefixes and rename the keys with diffusers' own conversion (:mod:`.layout`);
4. infer the config from the tensor shapes, build the model on the meta device, and check that the renamed keys are
   exactly the model's, with the model's shapes;
5. load the tensors (cast to ``dtype``, a LoRA merged in float32) into the model with ``assign=True``, so the
   weights exist once, and ``save_pretrained`` it in safetensors shards of at most ``max_shard_size``;
6. write the LoRA as an adapter (``lora_mode="adapter"``) and ``causal_config.json`` with the peer's sampling
   settings (:mod:`.peers`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import NoReturn

import torch
from diffusers import WanTransformer3DModel

from ..causal_config import CausalConfig
from .layout import diffusers_names, infer_config, is_original_wan_layout
from .lora import LoraLayer, check_lora, merged_weights, read_lora, save_lora_adapter
from .peers import FLAT, FORMAT_NAMES, FORMATS, WRAPPER, PeerFormat
from .reading import TensorMap, read_checkpoint, strip_wrapper_prefixes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_MODES = ("merge", "adapter")


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "auto",
    *,
    ema: bool | None = None,
    lora: str | os.PathLike | None = None,
    lora_mode: str = "merge",
    lora_alpha: float | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "10GB",
    num_attention_heads: int | None = None,
    attention_head_dim: int | None = None,
    causal_config: CausalConfig | Mapping | None = None,
) -> str:
    """Convert a causal Wan checkpoint into a diffusers model folder; returns ``out``.

    ``WanTransformer3DModel.from_pretrained(out)`` loads the result, and ``CausalConfig.load(out)`` its sampling
    settings (``out/causal_config.json``).

    Args:
        src: the downloaded checkpoint: a ``.pt`` (Self-Forcing, Causal-Forcing, CausVid, LongLive's base), a
            ``.safetensors`` (Krea, Wan2.1-1.3B), a ``*.safetensors.index.json`` of shards (Wan2.1-14B), or a folder
            holding one of the last two.
        out: the folder to write (created if needed).
        format: ``"auto"`` or one of ``self_forcing``, ``causal_forcing``, ``causvid``, ``longlive``, ``krea``,
            ``wan``; it selects the expected layout, the default ``ema`` and the sampling settings. ``"auto"`` tells
            the layout from the file and the peer from the released file's name.
        ema: convert ``generator_ema`` (``True``) or ``generator`` (``False``) of a wrapper checkpoint; ``None``
            takes what the peer's inference loads (Self-Forcing: EMA; the others: not), falling back to
            ``generator`` when a checkpoint has no EMA weights.
        lora: a LoRA file to apply (LongLive's ``lora.pt``, or any original-layout or diffusers Wan LoRA).
        lora_mode: ``"merge"`` adds it to the weights; ``"adapter"`` keeps the base weights and writes the LoRA to
            ``out/pytorch_lora_weights.safetensors``, a switchable PEFT adapter:
            ``transformer.load_lora_adapter(out, weight_name=LORA_WEIGHT_NAME, prefix="transformer")``.
        lora_alpha: the LoRA's alpha (its scale is ``alpha / rank``); default the rank, as LongLive's config has it.
        dtype: cast the weights (``torch.bfloat16`` or ``"bfloat16"``, ...); modules diffusers keeps in float32
            (norms, time embedder, modulation tables) stay float32. Default: as stored.
        max_shard_size: largest safetensors shard, as for ``save_pretrained``.
        num_attention_heads / attention_head_dim: the head split of the model width (the weights do not spell it
            out); default a head dim of 128, as in every Wan release. Tiny test models pass their own.
        causal_config: sampling settings replacing the peer's, whole (a :class:`CausalConfig`) or per key (a dict,
            e.g. ``{"chunk_frames": 1}`` for Causal-Forcing's frame-wise checkpoints).
    """
    if format not in FORMAT_NAMES:
        raise ValueError(f"format must be one of {list(FORMAT_NAMES)}, got {format!r}.")
    if lora_mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {list(LORA_MODES)}, got {lora_mode!r}.")
    dtype = _resolve_dtype(dtype)

    origin, contents = read_checkpoint(src)
    layout = _layout_of(origin, contents)
    peer = _pick_format(format, origin, layout, lora)
    sampling = _sampling(peer, causal_config)  # a bad setting fails before any work
    state, entry = _select_state(origin, contents, layout, peer, ema)
    where = f"{origin}[{entry!r}]" if entry else origin
    stored, model = _mapping(where, state, num_attention_heads, attention_head_dim)
    expected, config = model.state_dict(), model.config
    _check_shapes(where, expected, stored, state)
    layers: dict[str, LoraLayer] = {}
    if lora is not None:
        lora_origin, layers = read_lora(lora, lora_alpha)
        check_lora(lora_origin, layers, model)

    merged = merged_weights(layers, lambda key: state[stored[key]]) if lora_mode == "merge" else {}
    keep_fp32 = tuple(model._keep_in_fp32_modules or ()) if dtype is not None else ()
    weights = {}
    for key in expected:
        tensor, stored_dtype = merged[key] if key in merged else (state[stored[key]], None)
        weights[key] = _cast(key, tensor, dtype or stored_dtype or tensor.dtype, keep_fp32).contiguous()
    model.load_state_dict(weights, strict=True, assign=True)  # the tensors become the parameters: no copy

    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    if layers and lora_mode == "adapter":
        logger.info("wrote the LoRA adapter to %s", save_lora_adapter(out, layers, dtype))
    sampling.save(out)
    logger.info("converted %s (%s) -> %s: %d layers, %d heads of %d; sampling %s", where, peer.title, out,
                config["num_layers"], config["num_attention_heads"], config["attention_head_dim"], sampling.to_dict())
    return out


def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype must be one of {list(DTYPES)} (or the torch dtype), got {dtype!r}.")


def _sampling(peer: PeerFormat, causal_config) -> CausalConfig:
    """The peer's sampling settings, replaced whole by a :class:`CausalConfig` or per key by a dict."""
    if causal_config is None:
        return peer.sampling
    if isinstance(causal_config, CausalConfig):
        return causal_config
    return CausalConfig.from_dict({**peer.sampling.to_dict(), **causal_config}, origin="causal_config")


def _layout_of(origin: str, contents) -> str:
    if isinstance(contents, TensorMap):
        return FLAT
    if isinstance(contents, Mapping):
        if any(isinstance(value, Mapping) for value in contents.values()):
            return WRAPPER
        if contents and all(isinstance(value, torch.Tensor) for value in contents.values()):
            return FLAT
    keys = list(contents) if isinstance(contents, Mapping) else []
    _refuse_unknown_layout(origin, keys, f"a {type(contents).__name__}")


def _pick_format(format: str, origin: str, layout: str, lora) -> PeerFormat:
    if format != "auto":
        peer = FORMATS[format]
        if peer.layout != layout:
            raise ValueError(
                f"{origin} is laid out as {_describe(layout)} but format={format!r} expects {_describe(peer.layout)}; "
                "pass the peer's released file, or format='auto'."
            )
        return peer
    if lora is not None and layout == WRAPPER:
        return FORMATS["longlive"]  # a base checkpoint with a LoRA beside it is LongLive's release
    released_as = "/".join(os.path.abspath(origin).lower().split(os.sep)[-2:])  # file name and its folder
    for peer in FORMATS.values():
        if peer.layout == layout and any(hint in released_as for hint in peer.hints):
            return peer
    if layout == FLAT:
        return FORMATS["wan"]
    candidates = [name for name, peer in FORMATS.items() if peer.layout == WRAPPER]
    raise ValueError(
        f"cannot tell which causal checkpoint {origin} is: a wrapper .pt could be any of {candidates}, and its "
        "name says none of them; pass format= (--format) to choose the peer's sampling settings and EMA default."
    )


def _describe(layout: str) -> str:
    return ("a wrapper .pt of generator/generator_ema entries" if layout == WRAPPER
            else "one flat state dict (safetensors or .pt)")


def _select_state(origin: str, contents, layout: str, peer: PeerFormat, ema: bool | None):
    """``(TensorMap, wrapper entry or None)``: the state dict to convert."""
    if layout == FLAT:
        return (contents if isinstance(contents, TensorMap) else TensorMap(origin, contents)), None
    entries = {key: value for key, value in contents.items() if isinstance(value, Mapping)}
    if ema is None:
        wanted = ["generator_ema", "generator", "model"] if peer.ema else ["generator", "model"]
    else:
        wanted = ["generator_ema"] if ema else ["generator", "model"]
    for entry in wanted:
        if entry in entries:
            state = entries[entry]
            if not all(isinstance(value, torch.Tensor) for value in state.values()):
                break
            return TensorMap(origin, state), entry
    if ema and ({"generator", "model"} & entries.keys()):
        fix = "pass ema=False (--no-ema) to convert the non-EMA weights"
    elif not ema and "generator_ema" in entries:
        fix = "pass ema=True (--ema) to convert the EMA weights"
    else:
        fix = "pass the transformer checkpoint the peer released (a LoRA file goes to lora= / --lora)"
    raise ValueError(
        f"{origin} has no {wanted[0]!r} entry to convert (its entries: {sorted(entries)}, wanted one of {wanted} "
        f"holding tensors); {fix}."
    )


def _refuse_unknown_layout(where: str, keys: list, kind: str | None = None) -> NoReturn:
    sample = sorted(map(str, keys))[:8]
    looks_diffusers = any(str(k).startswith(("condition_embedder.", "proj_out.")) or ".attn1." in str(k) for k in keys)
    hint = " It looks like a diffusers state dict already: load its folder with from_pretrained." if looks_diffusers \
        else ""
    raise ValueError(
        f"{where} is not a Wan checkpoint layout the converter knows: expected the original Wan keys "
        "(patch_embedding.weight, blocks.<i>.self_attn.q.weight, head.head.weight, ...), possibly under 'model.' "
        f"or a wrapper's 'generator'/'generator_ema' entry, got {kind or f'{len(keys)} keys'} {sample}"
        f"{' ...' if len(keys) > 8 else ''}.{hint}"
    )


def _mapping(where: str, state: TensorMap, heads: int | None, head_dim: int | None):
    """``(diffusers key -> key in the file, the model on the meta device)``; refuses a state dict whose renamed keys
    are not exactly those of the model its shapes describe."""
    names, collisions = strip_wrapper_prefixes(state)
    if not is_original_wan_layout(names):
        _refuse_unknown_layout(where, list(state))
    renamed, unmapped = diffusers_names(names)
    stored = {key: names[clean] for key, clean in renamed.items()}
    config = infer_config(lambda key: state.shape(names[key]), names, heads, head_dim)
    with torch.device("meta"):  # no memory: the weights are assigned later
        model = WanTransformer3DModel(**config)
    expected = model.state_dict().keys()
    unmapped = sorted([names[k] for k in unmapped] + collisions + [stored[k] for k in stored if k not in expected])
    missing = sorted(key for key in expected if key not in stored)
    if unmapped or missing:
        raise ValueError(
            f"{where}: keys do not map onto WanTransformer3DModel: unmapped (in the file, not in the model) "
            f"{_listing(unmapped)}; missing (in the model, not in the file) {_listing(missing)}. A truncated or "
            "partial state dict, or a Wan variant the converter does not cover (Wan-Animate, VACE, FLF2V)."
        )
    return stored, model


def _check_shapes(where: str, expected: Mapping[str, torch.Tensor], stored: Mapping[str, str],
                  state: TensorMap) -> None:
    mismatched = [f"{stored[key]}: {state.shape(stored[key])} vs {tuple(expected[key].shape)}" for key in stored
                  if state.shape(stored[key]) != tuple(expected[key].shape)]
    if mismatched:
        raise ValueError(
            f"{where}: keys do not map onto WanTransformer3DModel with the shapes of the inferred config "
            f"(file vs model): {_listing(mismatched)}; check num_attention_heads / attention_head_dim."
        )


def _listing(items: list, limit: int = 12) -> str:
    return f"{items[:limit]}{f' and {len(items) - limit} more' if len(items) > limit else ''}"


def _cast(key: str, tensor: torch.Tensor, dtype: torch.dtype, keep_fp32: tuple[str, ...]) -> torch.Tensor:
    """``tensor`` in ``dtype``, except the modules named in ``keep_fp32`` (those diffusers keeps in float32 when it
    loads in half precision) when ``dtype`` is a half type."""
    if not tensor.is_floating_point():
        return tensor
    if dtype in (torch.float16, torch.bfloat16) and any(part in keep_fp32 for part in key.split(".")):
        dtype = torch.float32
    return tensor.to(dtype)
