"""Quantized checkpoints: fp8 weights dequantized on access, every other packing refused.

Two fp8 layouts are read:

* plain fp8: weights stored as ``float8_e4m3fn`` / ``float8_e5m2`` with no scale, upcast as they are;
* ComfyUI's scaled fp8 (the ``*_fp8_scaled`` files): a ``scaled_fp8`` marker tensor, and for each quantized layer an
  fp8 ``<layer>.weight`` with its ``<layer>.scale_weight`` (a float32 scalar, or one value per output channel), the
  weight being ``weight * scale_weight``. Its ``<layer>.scale_input`` entries scale activations for fp8 matmuls at
  run time; the weights do not need them and they are dropped.

Dequantized weights are float32 (``weight.float() * scale``, so a model loaded with them computes exactly what the
quantized layers stood for); the converter then casts them to its ``dtype``, bfloat16 by default. Weights packed in
integer types (NVFP4 as LongLive 2.0's FourOverSix ``model_4o6.pt`` stores it, int8, ...) are refused: each tool
packs them its own way, and their releases ship the unquantized weights too.
"""

from __future__ import annotations

import math

import torch

from .reading import Derived, TensorMap

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALED_FP8_MARKER = "scaled_fp8"
WEIGHT_SCALE_SUFFIX = ".scale_weight"
INPUT_SCALE_SUFFIX = ".scale_input"


def dequantized(state: TensorMap) -> tuple[TensorMap, bool]:
    """``(state with its fp8 weights dequantized to float32 and the scale entries left out, whether it held fp8)``;
    refuses weights in integer (packed) dtypes."""
    dtypes = {key: state.dtype(key) for key in state}
    packed = [f"{key} ({dtype or 'an unknown dtype'})" for key, dtype in dtypes.items()
              if dtype is None or not (dtype.is_floating_point or dtype.is_complex)]
    if packed:
        raise ValueError(
            f"{state.origin} holds quantized weights the converter cannot dequantize: {packed[:6]}"
            f"{' ...' if len(packed) > 6 else ''} are stored in integer (packed) dtypes. Convert the release's "
            "bf16/fp32 weights (LongLive 2.0: model_bf16.pt rather than an NVFP4 model_4o6.pt), or fp8 ones."
        )
    scales = [key for key in state if key.endswith(WEIGHT_SCALE_SUFFIX)]
    fp8 = [key for key, dtype in dtypes.items() if dtype in FP8_DTYPES and key != SCALED_FP8_MARKER]
    if not scales and not fp8:
        return state, False

    changes: dict[str, Derived | None] = {SCALED_FP8_MARKER: None}
    changes.update({key: None for key in state if key.endswith(INPUT_SCALE_SUFFIX)})
    for scale_key in scales:
        weight_key = scale_key.removesuffix(WEIGHT_SCALE_SUFFIX) + ".weight"
        if weight_key not in state:
            continue  # left in: reported as an unmapped key
        changes[scale_key] = None
        changes[weight_key] = _scaled(state, weight_key, scale_key)
    for key in fp8:
        changes.setdefault(key, _scaled(state, key, None))
    return state.replaced({key: change for key, change in changes.items() if key in state}), True


def _scaled(state: TensorMap, weight_key: str, scale_key: str | None) -> Derived:
    shape = state.shape(weight_key)
    if scale_key is None:
        return Derived(shape, torch.float32, lambda: state[weight_key].float())
    scale_shape = state.shape(scale_key)
    if math.prod(scale_shape) not in (1, shape[0] if shape else 1):
        raise ValueError(
            f"{state.origin}: {scale_key} of shape {scale_shape} is neither a scalar nor one value per output "
            f"channel of {weight_key} {shape}, so the converter cannot dequantize it; pass unquantized weights."
        )

    def load() -> torch.Tensor:
        weight, scale = state[weight_key].float(), state[scale_key].float()
        per_channel = scale.numel() > 1
        return weight * (scale.reshape(-1, *[1] * (weight.ndim - 1)) if per_channel else scale.reshape(()))

    return Derived(shape, torch.float32, load)
