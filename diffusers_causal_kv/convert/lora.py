"""LoRA files of the original Wan layout -> diffusers LoRA layers, merged into the weights or saved as an adapter.

LongLive ships its LoRA as ``lora.pt``: ``{"generator_lora": ..., "critic_lora": ..., "step": ...}``, the generator's
entry being PEFT's ``get_peft_model_state_dict`` of its ``CausalWanModel`` (keys
``base_model.model.blocks.<i>.self_attn.q.lora_A.weight``), rank 256 and alpha 256 over every ``nn.Linear`` of the
attention blocks (NVlabs/LongLive v1.0 utils/lora_utils.py and configs/longlive_inference.yaml; the alpha lives in
the config, not the file). After the PEFT and training-wrapper prefixes are stripped, the keys are renamed by
diffusers' own Wan LoRA conversion (``_convert_non_diffusers_wan_lora_to_diffusers``), which also folds any
``.alpha`` keys of other trainers' files into the weights. Files already in diffusers naming
(``transformer.blocks.<i>.attn1.to_q.lora_A.weight``) are taken as they are.

A layer computes ``W x + scale * B (A x)`` with ``scale = alpha / rank``. Merging adds ``scale * B @ A`` to ``W`` in
float32; the adapter is written in the diffusers LoRA format with ``scale`` folded into ``B``, so that diffusers'
loaders (whose default alpha is the rank) reproduce it exactly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers.loaders import WanLoraLoaderMixin
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

from .reading import INNER_WRAPPER_SEGMENTS, OUTER_PREFIXES, TensorMap, read_checkpoint

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
LORA_ENTRY = "generator_lora"  # LongLive's lora.pt
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME_SEGMENT = re.compile(r"\.(lora_[AB])\.(?!weight$|bias$)[^.]+\.(weight|bias)$")  # PEFT's ".default."
LORA_KEY = re.compile(r"\.lora_(A|B|down|up)\.")  # PEFT's and kohya's names of the two LoRA matrices


def is_lora_only(contents) -> bool:
    """Whether a checkpoint's contents are a LoRA and no model: LongLive's ``lora.pt`` (a ``generator_lora`` entry
    and no generator), or a state dict of LoRA layers (PEFT's ``lora_A``/``lora_B``, kohya's ``lora_down``/
    ``lora_up``) without the model's own weights."""
    if not isinstance(contents, Mapping):
        return False
    if isinstance(contents.get(LORA_ENTRY), Mapping):
        return not ({"generator", "generator_ema", "model"} & contents.keys())
    keys = [str(key) for key in contents]
    return any(LORA_KEY.search(key) for key in keys) and not any(k.endswith("patch_embedding.weight") for k in keys)


@dataclass
class LoraLayer:
    """One LoRA layer on diffusers module ``module``: ``down`` (A, ``[rank, in]``), ``up`` (B, ``[out, rank]``),
    ``bias`` (B's bias, or ``None``) and ``scale``."""

    module: str
    down: torch.Tensor
    up: torch.Tensor
    bias: torch.Tensor | None
    scale: float

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` in float32: what merging adds to the module's weight."""
        return self.scale * (self.up.float() @ self.down.float())


def read_lora(path: str | os.PathLike, alpha: float | None = None) -> tuple[str, dict[str, LoraLayer]]:
    """``(origin, diffusers module -> layer)`` of a LoRA file; ``alpha`` defaults to the rank (LongLive's config)."""
    origin, contents = read_checkpoint(path)
    state = _lora_state(origin, contents)
    converted = _to_diffusers(origin, state)
    layers = {}
    for key in sorted(converted):
        module, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        if part != "A.weight":
            continue
        down = converted[key]
        up = converted.get(f"transformer.{module}.lora_B.weight")
        if up is None:
            raise ValueError(
                f"{origin}: diffusers' Wan LoRA conversion does not map the LoRA onto whole layers: {module} has "
                "lora_A but no lora_B; pass the complete LoRA file."
            )
        rank = down.shape[0]
        layers[module] = LoraLayer(module, down, up, converted.get(f"transformer.{module}.lora_B.bias"),
                                   1.0 if alpha is None else alpha / rank)
    if not layers:
        raise ValueError(
            f"{origin}: diffusers' Wan LoRA conversion does not map any layer of it (keys {sorted(state)[:6]}); "
            "pass a LoRA file with lora_A/lora_B weights."
        )
    return origin, layers


def _lora_state(origin: str, contents) -> dict[str, torch.Tensor]:
    if isinstance(contents, Mapping) and isinstance(contents.get(LORA_ENTRY), Mapping):
        contents = contents[LORA_ENTRY]
    if not isinstance(contents, Mapping) or not all(isinstance(v, torch.Tensor) for v in contents.values()):
        entries = sorted(contents) if isinstance(contents, Mapping) else type(contents).__name__
        raise ValueError(
            f"{origin} has no {LORA_ENTRY!r} entry to convert and is not a LoRA state dict (it holds {entries}); "
            "pass LongLive's lora.pt or a LoRA state dict."
        )
    if isinstance(contents, TensorMap):
        contents = {key: contents[key] for key in contents}  # LoRA files are small: load them whole
    state = {}
    for key, tensor in contents.items():
        for segment in INNER_WRAPPER_SEGMENTS:
            key = key.replace(segment, "")
        key = ADAPTER_NAME_SEGMENT.sub(r".\1.\2", key.removeprefix(PEFT_PREFIX))
        for prefix in OUTER_PREFIXES:
            key = key.removeprefix(prefix)
        state[key] = tensor
    return state


def _to_diffusers(origin: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if any(key.startswith("transformer.") for key in state):
        return state
    try:
        return _convert_non_diffusers_wan_lora_to_diffusers({f"diffusion_model.{k}": v for k, v in state.items()})
    except (ValueError, KeyError, IndexError) as error:
        sample = sorted(state)[:6]
        raise ValueError(
            f"{origin}: diffusers' Wan LoRA conversion does not map its keys ({type(error).__name__}: {error}); "
            f"keys after stripping the PEFT and wrapper prefixes: {sample}{' ...' if len(state) > 6 else ''}. "
            "Pass a LoRA of the original Wan layout (blocks.<i>.self_attn.q.lora_A.weight) or of diffusers'."
        ) from None


def check_lora(origin: str, layers: Mapping[str, LoraLayer], model: torch.nn.Module) -> None:
    """Refuse layers that target no ``nn.Linear`` of ``model`` or whose shapes do not fit it."""
    modules = dict(model.named_modules())
    misfits = []
    for name, layer in layers.items():
        target = modules.get(name)
        if not isinstance(target, torch.nn.Linear):
            misfits.append(f"{name} (no such linear layer)")
            continue
        rank = layer.down.shape[0]
        fits = (tuple(layer.down.shape) == (rank, target.in_features)
                and tuple(layer.up.shape) == (target.out_features, rank)
                and (layer.bias is None or tuple(layer.bias.shape) == (target.out_features,)))
        if not fits:
            misfits.append(f"{name} (A {tuple(layer.down.shape)}, B {tuple(layer.up.shape)} for a "
                           f"{target.in_features} -> {target.out_features} layer)")
    if misfits:
        raise ValueError(
            f"{origin}: LoRA layers do not fit the model converted from the checkpoint: {misfits[:6]}"
            f"{' ...' if len(misfits) > 6 else ''}; pass the LoRA trained on this checkpoint."
        )


def merged_weights(layers: Mapping[str, LoraLayer], weight_of) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """Diffusers key -> ``(float32 tensor with the LoRA added, the base tensor's dtype)`` for the weights (and
    biases) of the LoRA-targeted modules; ``weight_of(key)`` gives a base tensor by diffusers key."""
    merged = {}
    for name, layer in layers.items():
        weight = weight_of(f"{name}.weight")
        merged[f"{name}.weight"] = (weight.float() + layer.delta(), weight.dtype)
        if layer.bias is not None:
            bias = weight_of(f"{name}.bias")
            merged[f"{name}.bias"] = (bias.float() + layer.scale * layer.bias.float(), bias.dtype)
    return merged


def save_lora_adapter(out: str, layers: Mapping[str, LoraLayer], dtype: torch.dtype | None
                      ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Write the layers as a diffusers LoRA (``scale`` folded into B) to ``out/pytorch_lora_weights.safetensors``;
    returns the (shape, dtype) of each tensor written, by key. Load it with ``transformer.load_lora_adapter(out,
    weight_name=..., prefix="transformer")`` or ``pipe.load_lora_weights(out)``."""
    stored = next(iter(layers.values())).down.dtype  # B is scaled in float32: store it as the file did
    tensors = {}
    for name, layer in layers.items():
        tensors[f"{name}.lora_A.weight"] = layer.down
        tensors[f"{name}.lora_B.weight"] = layer.up.float() * layer.scale
        if layer.bias is not None:
            tensors[f"{name}.lora_B.bias"] = layer.bias.float() * layer.scale
    tensors = {key: t.to(dtype or stored).contiguous() for key, t in tensors.items()}
    WanLoraLoaderMixin.save_lora_weights(out, transformer_lora_layers=tensors, weight_name=LORA_WEIGHT_NAME)
    return {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}
