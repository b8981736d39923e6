""":func:`convert_checkpoint`: a published causal Wan checkpoint -> a diffusers ``WanTransformer3DModel`` folder.

The steps, each refusing what it cannot do with an error that names the file and the keys:

1. read the file lazily (:mod:`.reading`) and tell its layout: a wrapper ``.pt`` of ``generator``/``generator_ema``
   entries, one flat state dict, or a folder holding the two experts of a Wan2.2 A14B model (:mod:`.experts`);
2. pick the peer (``format``, or from the layout and the released file's name) and, in a wrapper, the entry the
   peer's inference loads (``ema``);
3. dequantize fp8 weights (:mod:`.quantized`), strip the training wrappers' prefixes and rename the keys with
   diffusers' own conversion (:mod:`.layout`); an expert may already be in diffusers naming;
4. infer the config from the tensor shapes, build the model on the meta device, and check that the renamed keys are
   exactly the model's, with the model's shapes; a LoRA-only checkpoint takes its weights from ``base``;
5. load the tensors (cast to ``dtype``, a LoRA merged in float32) into the model with ``assign=True``, so the
   weights exist once, and ``save_pretrained`` it in safetensors shards of at most ``max_shard_size`` (the two
   experts into ``transformer/`` and ``transformer_2/``, both checked before either is written);
6. write the LoRA as an adapter (``lora_mode="adapter"``), ``causal_config.json`` with the peer's sampling
   settings (:mod:`.peers`) and the model card (:mod:`.card`).

All of it is written into a new folder beside ``out`` and checked (each model loads with stock ``from_pretrained``
with exactly the planned keys, shapes and dtypes; the LoRA and the sampling settings read back as written) before it
takes ``out``'s place (:mod:`.output`): a failure at any step leaves ``out`` as it was.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

import torch
from diffusers import WanTransformer3DModel

from ..causal_config import CausalConfig
from .card import Conversion, write_model_card
from .experts import OUT_NAMES, expert_sources
from .layout import diffusers_names, infer_config, is_diffusers_layout, is_original_wan_layout
from .lora import LORA_WEIGHT_NAME, LoraLayer, check_lora, is_lora_only, merged_weights, read_lora, save_lora_adapter
from .output import Planned, check_destination, check_written, check_written_lora, staged
from .peers import EXPERTS, FLAT, FORMAT_NAMES, FORMATS, REFUSED, WRAPPER, PeerFormat, RefusedRelease
from .quantized import dequantized
from .reading import TensorMap, read_checkpoint, strip_wrapper_prefixes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_MODES = ("merge", "adapter")
DEFAULT_SHARD_SIZE = "10GB"
SHARD_SIZE = re.compile(r"\s*\d+(\.\d*)?\s*[KMGT]B\s*", re.IGNORECASE)  # what huggingface_hub parses


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "auto",
    *,
    ema: bool | None = None,
    lora: str | os.PathLike | None = None,
    lora_mode: str = "merge",
    lora_alpha: float | None = None,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    num_attention_heads: int | None = None,
    attention_head_dim: int | None = None,
    causal_config: CausalConfig | Mapping | None = None,
    overwrite: bool = False,
) -> str:
    """Convert a causal Wan checkpoint into a diffusers model folder; returns ``out``.

    ``WanTransformer3DModel.from_pretrained(out)`` loads the result (for a Wan2.2 A14B checkpoint:
    ``from_pretrained(out, subfolder="transformer")`` and ``subfolder="transformer_2"``), and
    ``CausalConfig.load(out)`` its sampling settings (``out/causal_config.json``).

    Args:
        src: the downloaded checkpoint: a ``.pt`` (Self-Forcing, Causal-Forcing, CausVid, LongLive's base, LongLive
            2.0's ``model_bf16.pt``), a ``.safetensors`` (Krea, Wan2.1-1.3B), a ``*.safetensors.index.json`` of
            shards (Wan2.1-14B), a folder holding one of the last two, or a folder holding the two experts of a
            Wan2.2 A14B model (``transformer/`` and ``transformer_2/``, or ``high_noise_model/`` and
            ``low_noise_model/``: FastVideo's CausalWan2.2-I2V-A14B, the official Wan2.2 releases). fp8 weights
            (plain or ComfyUI's scaled fp8) are dequantized.
        out: the folder to write, with its parents if needed. It must not exist or be an empty folder unless
            ``overwrite``, and must not be, lie inside or hold a file the conversion reads.
        format: ``"auto"`` or one of ``self_forcing``, ``causal_forcing``, ``causvid``, ``longlive2``, ``longlive``,
            ``krea``, ``rolling_forcing``, ``causal_forcing_pp_2step``, ``causal_forcing_pp_1step``,
            ``fastvideo_a14b``, ``wan22_a14b``, ``wan``; it selects the expected layout, the default ``ema`` and the
            sampling settings. ``"auto"`` tells the layout from the file and the peer from the released file's own
            name, else from its folder's name (logged, with the reason). ``reward_forcing``, ``streamdiffusionv2``
            and ``memflow`` (and files ``"auto"`` recognises as theirs) are refused with ``NotImplementedError``:
            their inference needs a mechanism the engines do not have (:data:`~.peers.REFUSED` says which).
        ema: convert ``generator_ema`` (``True``) or ``generator`` (``False``) of a wrapper checkpoint; ``None``
            takes what the peer's inference loads (Self-Forcing: EMA; the others: not), falling back to
            ``generator`` when a checkpoint has no EMA weights.
        lora: a LoRA file to apply (LongLive's ``lora.pt``, or any original-layout or diffusers Wan LoRA).
        lora_mode: ``"merge"`` adds it to the weights; ``"adapter"`` keeps the base weights and writes the LoRA to
            ``out/pytorch_lora_weights.safetensors``, a switchable PEFT adapter:
            ``transformer.load_lora_adapter(out, weight_name=LORA_WEIGHT_NAME, prefix="transformer")``.
        lora_alpha: the LoRA's alpha (its scale is ``alpha / rank``); default the rank, as LongLive's config has it.
        base: for a LoRA-only ``src`` (one LoRA, or a folder of the two experts' LoRAs): the checkpoint it was
            trained on (for two experts, a folder of both), whose weights the LoRA is applied to.
        dtype: cast the weights (``torch.bfloat16`` or ``"bfloat16"``, ...); modules diffusers keeps in float32
            (norms, time embedder, modulation tables) stay float32. Default: as stored, and bfloat16 for weights
            dequantized from fp8.
        max_shard_size: largest safetensors shard, as for ``save_pretrained``.
        num_attention_heads / attention_head_dim: the head split of the model width (the weights do not spell it
            out); default a head dim of 128, as in every Wan release. Tiny test models pass their own.
        causal_config: sampling settings replacing the peer's, whole (a :class:`CausalConfig`) or per key (a dict,
            e.g. ``{"chunk_frames": 1}`` for Causal-Forcing's frame-wise checkpoints).
        overwrite: replace an existing ``out`` whole (none of its files survives), once the new folder is complete.
    """
    if format not in FORMAT_NAMES:
        raise ValueError(f"format must be one of {list(FORMAT_NAMES)}, got {format!r}.")
    if format in REFUSED:
        _refuse(REFUSED[format], f"format={format!r} was given")
    if lora_mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {list(LORA_MODES)}, got {lora_mode!r}.")
    options = _Options(lora_mode, _checked_alpha(lora_alpha), _resolve_dtype(dtype), _checked_shard_size(
        max_shard_size), num_attention_heads, attention_head_dim)
    if isinstance(causal_config, Mapping):
        CausalConfig.from_dict(causal_config, origin="causal_config= (--set)")  # a bad setting fails before any work
    out = os.fspath(out)
    check_destination(out, (src, lora, base), overwrite)
    command = _Command(src, out, format, ema, lora, base, overwrite)

    experts = expert_sources(os.fspath(src)) if os.path.isdir(src) else None
    if experts is not None:
        return _convert_experts(os.fspath(src), experts, out, format, lora, base, options, causal_config, command)
    if base is not None:
        _check_lora_only(src, lora)
        src, lora = base, src

    origin, contents = read_checkpoint(src)
    if is_lora_only(contents):
        _refuse_lora_only(origin, contents)
    layout = _layout_of(origin, contents)
    peer, reason = _pick_format(format, origin, layout, lora)
    logger.info("format %s: %s", peer.name, reason)
    sampling = _sampling(peer, causal_config)
    state, entry = _select_state(origin, contents, layout, peer, ema)
    where = f"{origin}[{entry!r}]" if entry else origin
    prepared = _prepare(where, state, lora, options)
    _write_all(out, {"": prepared}, options, peer, reason, sampling, command)
    logger.info("converted %s (%s) -> %s; sampling %s", where, peer.title, out, sampling.to_dict())
    return out


@dataclass(frozen=True)
class _Options:
    """The conversion options every model of a checkpoint is written with."""

    lora_mode: str
    lora_alpha: float | None
    dtype: torch.dtype | None
    max_shard_size: int | str
    heads: int | None
    head_dim: int | None


@dataclass
class _Prepared:
    """One model, checked and ready to write: its state, the diffusers key -> stored key map, the model on the meta
    device, its LoRA layers (and their file), and whether its weights were dequantized from fp8."""

    where: str
    state: TensorMap
    stored: dict[str, str]
    model: WanTransformer3DModel
    layers: dict[str, LoraLayer]
    was_fp8: bool
    lora_origin: str | None = None


@dataclass(frozen=True)
class _Command:
    """The arguments of a conversion that are not among its :class:`_Options`, for its command line."""

    src: object
    out: str
    format: str
    ema: bool | None
    lora: object
    base: object
    overwrite: bool

    def line(self, options: _Options, sampling_changes: Mapping) -> str:
        """``python -m diffusers_causal_kv.convert ...`` doing this conversion."""
        args = ["python", "-m", "diffusers_causal_kv.convert", os.fspath(self.src), self.out]
        if self.format != "auto":
            args += ["--format", self.format]
        if self.ema is not None:
            args.append("--ema" if self.ema else "--no-ema")
        if self.lora is not None:
            args += ["--lora", os.fspath(self.lora)]
        if options.lora_mode != "merge":
            args += ["--lora-mode", options.lora_mode]
        if options.lora_alpha is not None:
            args += ["--lora-alpha", repr(float(options.lora_alpha))]
        if self.base is not None:
            args += ["--base", os.fspath(self.base)]
        if options.dtype is not None:
            args += ["--dtype", next(name for name, dtype in DTYPES.items() if dtype == options.dtype)]
        if options.max_shard_size != DEFAULT_SHARD_SIZE:
            args += ["--max-shard-size", str(options.max_shard_size)]
        if options.heads is not None:
            args += ["--num-attention-heads", str(options.heads)]
        if options.head_dim is not None:
            args += ["--attention-head-dim", str(options.head_dim)]
        for key, value in sampling_changes.items():
            args += ["--set", f"{key}={json.dumps(value)}"]
        if self.overwrite:
            args.append("--overwrite")
        return shlex.join(args)


def _prepare(where: str, state: TensorMap, lora, options: _Options, accept_diffusers: bool = False) -> _Prepared:
    """Check that ``state`` (and ``lora``) make a complete ``WanTransformer3DModel``; nothing is loaded yet."""
    state, was_fp8 = dequantized(state)
    stored, model = _mapping(where, state, options.heads, options.head_dim, accept_diffusers)
    _check_shapes(where, model.state_dict(), stored, state)
    layers: dict[str, LoraLayer] = {}
    lora_origin = None
    if lora is not None:
        lora_origin, layers = read_lora(lora, options.lora_alpha)
        check_lora(lora_origin, layers, model)
    return _Prepared(where, state, stored, model, layers, was_fp8, lora_origin)


def _write_all(out: str, models: Mapping[str, _Prepared], options: _Options, peer: PeerFormat, reason: str,
               sampling: CausalConfig, command: _Command) -> None:
    """Write the models (by subfolder, ``""`` for ``out`` itself), the sampling settings and the model card into a
    new folder beside ``out``, check them, and move the folder into ``out``'s place."""
    peer_settings = peer.sampling.to_dict()
    changes = {key: value for key, value in sampling.to_dict().items() if value != peer_settings[key]}
    sources = [source for p in models.values() for source in (p.where, p.lora_origin) if source is not None]
    conversion = Conversion(peer, reason, sources, {name: dict(p.model.config) for name, p in models.items()},
                            sampling, command.line(options, changes),
                            lora_adapter=options.lora_mode == "adapter" and any(p.layers for p in models.values()))
    with staged(out, command.overwrite) as folder:
        for name, prepared in models.items():
            _write(prepared, os.path.join(folder, name), options)
        sampling.save(folder)
        write_model_card(folder, conversion)
        written = CausalConfig.load(folder)
        if written != sampling or written.source != sampling.source:
            _refuse_written_sampling(folder, sampling, written)


def _refuse_written_sampling(folder: str, sampling: CausalConfig, written: CausalConfig) -> NoReturn:
    raise RuntimeError(
        f"the converted folder failed its check after writing: {folder}/causal_config.json reads back as "
        f"{written.to_dict()}, not {sampling.to_dict()}. Nothing was moved into OUT, which is as it was; check the "
        "disk and run the conversion again."
    )


def _write(prepared: _Prepared, out: str, options: _Options) -> None:
    """Load the weights of a prepared model (merging its LoRA, casting), save it into ``out`` and check what was
    written."""
    state, stored, model, layers = prepared.state, prepared.stored, prepared.model, prepared.layers
    dtype = options.dtype or (torch.bfloat16 if prepared.was_fp8 else None)
    merged = merged_weights(layers, lambda key: state[stored[key]]) if options.lora_mode == "merge" else {}
    keep_fp32 = tuple(model._keep_in_fp32_modules or ()) if dtype is not None else ()
    weights = {}
    for key in model.state_dict():
        tensor, stored_dtype = merged[key] if key in merged else (state[stored[key]], None)
        weights[key] = _cast(key, tensor, dtype or stored_dtype or tensor.dtype, keep_fp32).contiguous()
    model.load_state_dict(weights, strict=True, assign=True)  # the tensors become the parameters: no copy
    planned: Planned = {key: (tuple(t.shape), t.dtype) for key, t in weights.items()}
    del weights

    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, max_shard_size=options.max_shard_size, safe_serialization=True)
    check_written(out, planned)
    if layers and options.lora_mode == "adapter":
        check_written_lora(out, LORA_WEIGHT_NAME, save_lora_adapter(out, layers, dtype))
        logger.info("wrote the LoRA adapter %s", LORA_WEIGHT_NAME)
    config = model.config
    logger.info("wrote %s: %d layers, %d heads of %d", prepared.where, config["num_layers"],
                config["num_attention_heads"], config["attention_head_dim"])


def _convert_experts(src: str, experts: tuple[str, str], out: str, format: str, lora, base, options: _Options,
                     causal_config, command: _Command) -> str:
    """Convert the two experts of a Wan2.2 A14B checkpoint into ``out/transformer`` and ``out/transformer_2``."""
    if lora is not None:
        raise ValueError(
            f"{src} holds two experts, and lora= (--lora) applies one LoRA to one model: put the experts' LoRAs "
            "in a folder as SRC (transformer/ and transformer_2/, or high_noise_model.safetensors and "
            "low_noise_model.safetensors) and pass the two-expert base as base= (--base)."
        )
    peer, reason = _pick_format(format, src, EXPERTS, None)
    logger.info("format %s: %s", peer.name, reason)
    sampling = _sampling(peer, causal_config)
    bases = None
    if base is not None:
        bases = expert_sources(os.fspath(base)) if os.path.isdir(base) else None
        if bases is None:
            raise ValueError(
                f"base {base} holds no Wan2.2 A14B experts (transformer/ and transformer_2/, or high_noise_model/ "
                f"and low_noise_model/) to merge the experts' LoRAs of {src} onto; pass the base model's folder."
            )
    prepared = []
    for index, path in enumerate(experts):
        where, state = _read_expert(path, peer)
        if bases is None:
            prepared.append(_prepare(where, state, None, options, accept_diffusers=True))
            continue
        if not is_lora_only(state):
            _refuse_base(path, "holds model weights, not only a LoRA")
        prepared.append(_prepare(*_read_expert(bases[index], peer), path, options, accept_diffusers=True))
    configs = [dict(p.model.config) for p in prepared]
    if configs[0] != configs[1]:
        differing = [f"{key}: {configs[0][key]} vs {configs[1][key]}" for key in sorted(configs[0])
                     if configs[0][key] != configs[1][key]]
        raise ValueError(
            f"{src}: the two experts do not share one config ({'; '.join(differing)}); both experts of a Wan2.2 "
            "A14B model have the same architecture: pass the two experts of one release."
        )
    _write_all(out, dict(zip(OUT_NAMES, prepared)), options, peer, reason, sampling, command)
    logger.info("converted the experts of %s (%s) -> %s; sampling %s", src, peer.title, out, sampling.to_dict())
    return out


def _read_expert(path: str, peer: PeerFormat) -> tuple[str, TensorMap]:
    """``(where, state)`` of one expert: its file(s), and the state dict (a wrapper's generator entry, if any)."""
    origin, contents = read_checkpoint(path)
    state, entry = _select_state(origin, contents, _layout_of(origin, contents), peer, None)
    return (f"{origin}[{entry!r}]" if entry else origin), state


def _check_lora_only(src, lora) -> None:
    """Refuse ``base=`` unless ``src`` holds only LoRA weights and no ``lora=`` comes with it."""
    if lora is None and is_lora_only(read_checkpoint(src)[1]):
        return
    _refuse_base(src, "comes with lora= too" if lora is not None else "holds model weights, not only a LoRA")


def _refuse_base(src, reason: str) -> NoReturn:
    raise ValueError(
        f"base= (--base) merges a LoRA-only checkpoint onto its base model, but {src} {reason}; convert a full "
        "checkpoint without base=, or pass the LoRA as SRC (or as lora= with the base as SRC)."
    )


def _refuse_lora_only(where: str, contents: Mapping) -> NoReturn:
    sample = sorted(map(str, contents))[:4]
    raise ValueError(
        f"{where} holds only LoRA weights ({sample} ...), not a model: pass the checkpoint it was trained on as "
        "base= (--base) (for two experts, the folder of both), or that checkpoint as SRC and this file as lora= "
        "(--lora)."
    )


def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype must be one of {list(DTYPES)} (or the torch dtype), got {dtype!r}.")


def _checked_alpha(alpha) -> float | None:
    if alpha is None or (isinstance(alpha, numbers.Real) and not isinstance(alpha, bool) and math.isfinite(alpha)
                         and alpha > 0):
        return alpha
    raise ValueError(f"lora_alpha must be a finite number > 0 (or None: the LoRA's rank), got {alpha!r}.")


def _checked_shard_size(size):
    if isinstance(size, str) and SHARD_SIZE.fullmatch(size) and float(size.strip()[:-2]) > 0 or (
            isinstance(size, int) and not isinstance(size, bool) and size > 0):
        return size
    raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB' (KB, MB, GB, TB), "
                     f"got {size!r}.")


def _sampling(peer: PeerFormat, causal_config) -> CausalConfig:
    """The peer's sampling settings, replaced whole by a :class:`CausalConfig` or per key by a dict."""
    if causal_config is None:
        return peer.sampling
    if isinstance(causal_config, CausalConfig):
        return causal_config
    return CausalConfig.from_dict({**peer.sampling.to_dict(), **causal_config}, origin="causal_config= (--set)")


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


def _pick_format(format: str, origin: str, layout: str, lora) -> tuple[PeerFormat, str]:
    """``(the peer, why)``: ``format`` when given; under ``"auto"``, the peer the file's own name names, else its
    folder's name (a downloaded file keeps its release name more often than its folder does)."""
    if format != "auto":
        peer = FORMATS[format]
        if peer.layout != layout:
            raise ValueError(
                f"{origin} is laid out as {_describe(layout)} but format={format!r} expects {_describe(peer.layout)}; "
                "pass the peer's released file, or format='auto'."
            )
        return peer, f"format={format!r} was given"
    path = os.path.abspath(origin)
    named, because = [], "its name names no causal release"
    for whose, name in (("its", os.path.basename(path)), ("its folder's", os.path.basename(os.path.dirname(path)))):
        refused = [(release, hint) for release in REFUSED.values() for hint in release.hints if hint in name.lower()]
        if refused and layout == WRAPPER:
            _refuse(refused[0][0], f"{whose} name {name!r} has {refused[0][1]!r}")
        named = [(peer, hint) for peer in FORMATS.values() if peer.layout == layout
                 for hint in peer.hints if hint in name.lower()]
        if named:
            because = f"{whose} name {name!r} has {named[0][1]!r}"
            break
    peers = [peer for peer, _ in named]
    if lora is not None and layout == WRAPPER:
        # a base checkpoint with a LoRA beside it is LongLive's release, 2.0 when its name says so
        peer = FORMATS["longlive2"] if FORMATS["longlive2"] in peers else FORMATS["longlive"]
        return peer, f"a wrapper .pt comes with a LoRA, as LongLive releases it ({because})"
    if peers:
        return peers[0], because
    if layout == FLAT:
        return FORMATS["wan"], f"a flat state dict whose {because}: the original Wan layout"
    if layout == EXPERTS:
        return FORMATS["wan22_a14b"], f"a folder of two experts whose {because}: the official Wan2.2 A14B"
    candidates = [name for name, peer in FORMATS.items() if peer.layout == WRAPPER]
    raise ValueError(
        f"cannot tell which causal checkpoint {origin} is: a wrapper .pt could be any of {candidates}, and neither "
        "its name nor its folder's names one of them; pass format= (--format) to choose the peer's sampling "
        "settings and EMA default."
    )


def _refuse(release: RefusedRelease, because: str) -> NoReturn:
    raise NotImplementedError(
        f"{release.title} checkpoints cannot be converted ({because}): its inference needs {release.needs}, which "
        f"this package's engines do not have. {release.instead}"
    )


def _describe(layout: str) -> str:
    return {WRAPPER: "a wrapper .pt of generator/generator_ema entries",
            FLAT: "one flat state dict (safetensors or .pt)",
            EXPERTS: "a folder of two Wan2.2 A14B experts"}[layout]


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


def _refuse_unknown_layout(where: str, keys: list, kind: str | None = None, diffusers_hint: bool = True) -> NoReturn:
    sample = sorted(map(str, keys))[:8]
    looks_diffusers = any(str(k).startswith(("condition_embedder.", "proj_out.")) or ".attn1." in str(k) for k in keys)
    hint = " It looks like a diffusers state dict already: load its folder with from_pretrained." \
        if looks_diffusers and diffusers_hint else ""
    raise ValueError(
        f"{where} is not a Wan checkpoint layout the converter knows: expected the original Wan keys "
        "(patch_embedding.weight, blocks.<i>.self_attn.q.weight, head.head.weight, ...), possibly under 'model.' "
        f"or a wrapper's 'generator'/'generator_ema' entry, got {kind or f'{len(keys)} keys'} {sample}"
        f"{' ...' if len(keys) > 8 else ''}.{hint}"
    )


def _mapping(where: str, state: TensorMap, heads: int | None, head_dim: int | None, accept_diffusers: bool = False):
    """``(diffusers key -> key in the file, the model on the meta device)``; refuses a state dict whose renamed keys
    are not exactly those of the model its shapes describe. ``accept_diffusers``: a state dict already in diffusers
    naming is taken as it is (the experts of a diffusers pipeline folder)."""
    names, collisions = strip_wrapper_prefixes(state)
    if is_original_wan_layout(names):
        renamed, unmapped = diffusers_names(names)
        config = infer_config(lambda key: state.shape(names[key]), names, heads, head_dim)
    elif accept_diffusers and is_diffusers_layout(names):
        renamed, unmapped = {key: key for key in names}, []
        config = infer_config(lambda key: state.shape(names[key]), names, heads, head_dim, diffusers_keys=True)
    elif is_lora_only(names):
        _refuse_lora_only(where, state)
    else:
        _refuse_unknown_layout(where, list(state), diffusers_hint=not accept_diffusers)
    stored = {key: names[clean] for key, clean in renamed.items()}
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
