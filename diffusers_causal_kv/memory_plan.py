"""How much device memory a causal Wan rollout needs, before loading anything: weights, the self- and
cross-attention KV cache, the peak activations of one chunk forward and of the streaming VAE decode, per device.

``memory_plan("wan2.1-14b", height=480, width=832, num_frames=81, chunk_frames=3, weights="fp8")`` returns a
:class:`MemoryPlan`; ``python -m diffusers_causal_kv.memory_plan wan2.1-14b --weights fp8 --budget-gib 24`` prints it.

What is exact and what is estimated:

* weights: the parameter count of the configuration (the model built on the ``meta`` device), the blocks' Linear
  weights in the chosen format, everything else in bf16 (fp32 for the modules diffusers keeps in fp32); with
  ``offload="model"`` one expert at a time, with ``offload="group"`` (block-level, one block per group) the weights
  outside the blocks plus two blocks (the one running and the one prefetched);
* the KV cache: exact, as the engines allocate it (``engine.memory_bytes()``): every latent frame, or the
  ``window_frames - 1`` frames a rolling engine holds; one tag per guidance branch; the fp8 layout of
  :mod:`~diffusers_causal_kv.kv_cache.quantized`; each expert of a two-expert model holds its own;
* activations: an upper estimate from the tensors one Wan block holds at its peak (the residual and its fp32 norm,
  the projections, the RoPE temporaries, ``[prefix | chunk]`` K/V copies, or the feed-forward's two hidden tensors);
  checked against the live tensor bytes of real forwards (``tests/test_memory_plan.py``: never below them, at most
  1.6x above);
* the VAE decode: a rough estimate of the streaming decoder's peak for one latent frame in float32 (six tensors of
  four video frames at full resolution with the top stage's 96 channels); not yet checked against a measurement.

The text encoder is not counted: encode the prompt first, then offload or free it (recipes: ``docs/low-vram.md``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

from .kv_cache.quantized import _layout

GIB = 1024**3
_WAN = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", attention_head_dim=128)
#: Named transformer configurations (diffusers' ``config.json`` of the released checkpoints) and their experts.
PRESETS = {
    "wan2.1-1.3b": ({**_WAN, "num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960}, 1),
    "wan2.1-14b": ({**_WAN, "num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824}, 1),
    "wan2.2-a14b": ({**_WAN, "num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824}, 2),
}
#: Bytes per value of the blocks' Linear weights (GGUF: block bytes over block values; int8 and fp8 add one float32
#: scale per output row, counted separately).
WEIGHT_FORMATS = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "gguf-q8_0": 34 / 32, "gguf-q4_0": 18 / 32,
                  "gguf-q4_k": 144 / 256}
CACHE_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OFFLOAD_MODES = ("none", "model", "group")
_VAE_TOP_CHANNELS = 96  # the Wan2.1 VAE decoder's full-resolution stage (base_dim)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (per rank under context parallelism); ``peak`` is their sum: weights, cache and the larger
    of the transformer's and the decoder's activations (they do not run at once)."""

    weights: int
    self_cache: int
    cross_cache: int
    activations: int
    vae_decode: int

    @property
    def peak(self) -> int:
        return self.weights + self.self_cache + self.cross_cache + max(self.activations, self.vae_decode)

    def fits(self, budget_bytes: float) -> bool:
        """Whether :attr:`peak` fits ``budget_bytes`` (leave the CUDA context and allocator slack out of it)."""
        return self.peak <= budget_bytes

    def table(self) -> str:
        rows = [*asdict(self).items(), ("peak", self.peak)]
        return "\n".join(f"{name:<12} {value / GIB:8.2f} GiB" for name, value in rows)


def memory_plan(model="wan2.1-1.3b", *, height: int = 480, width: int = 832, num_frames: int = 81,
                chunk_frames: int = 3, window_frames: int | None = None, sink_frames: int = 0,
                guidance_scale: float = 1.0, batch_size: int = 1, weights: str = "bf16", cache_dtype: str = "bf16",
                compute_dtype: str = "bf16", offload: str = "none", text_len: int = 512,
                context_parallel: int = 1, experts: int | None = None) -> MemoryPlan:
    """The memory of a rollout of ``num_frames`` video frames (``(num_frames - 1) // 4 + 1`` latent frames) at
    ``height`` x ``width``, in chunks of ``chunk_frames`` latent frames.

    Args:
        model: a preset name (:data:`PRESETS`), a transformer ``config.json`` path or folder, or a config dict.
        window_frames: the rolling engine's window in latent frames (``None``: every frame is kept).
        guidance_scale: above 1, a second cache tag and a batch of two in each forward (classifier-free guidance).
        weights: a key of :data:`WEIGHT_FORMATS`; ``"nvfp4"`` is refused (no diffusers loader runs it).
        cache_dtype: ``"fp8"`` for the fp8 cache (``kv_dtype=torch.float8_e4m3fn``), else the dtype K/V are kept in.
        offload: ``"none"``, ``"model"`` (``enable_model_cpu_offload``) or ``"group"`` (block-level group
            offloading, one block per group).
        context_parallel: ranks sharing each frame's tokens (``causal_cp_plan``); bytes are per rank.
        experts: transformers holding their own cache (2 for Wan2.2 A14B); default the preset's, else 1.
    """
    config, preset_experts = _config(model)
    experts = preset_experts if experts is None else experts
    _check(weights, cache_dtype, compute_dtype, offload, height, width, chunk_frames, window_frames, sink_frames,
           context_parallel)
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    dim, layers = heads * head_dim, config["num_layers"]
    patch = config["patch_size"]
    frame_tokens = (height // 8 // patch[1]) * (width // 8 // patch[2]) // context_parallel
    latent_frames = (num_frames - 1) // 4 + 1
    tags = 2 if guidance_scale > 1 else 1
    held = latent_frames if window_frames is None else window_frames - 1
    per_token_head = _cached_bytes(head_dim, frame_tokens, cache_dtype)
    self_cache = 2 * layers * tags * batch_size * held * frame_tokens * heads * per_token_head * experts
    cross_cache = 2 * layers * tags * batch_size * text_len * heads * _cached_bytes(head_dim, text_len, cache_dtype)
    a = CACHE_DTYPES[compute_dtype]
    rows = batch_size * tags
    chunk = chunk_frames * frame_tokens
    prefix = (latent_frames - chunk_frames if window_frames is None else window_frames - chunk_frames) * frame_tokens
    attention = chunk * dim * (8 * a + 12) + 2 * (prefix + chunk) * dim * a
    cross = chunk * dim * (5 * a + 4) + (2 * text_len * dim * a if cache_dtype == "fp8" else 0)
    ffn = chunk * dim * (3 * a + 4) + 2 * chunk * config["ffn_dim"] * a
    activations = rows * max(attention, cross, ffn)
    vae = 4 * (height // context_parallel) * width * _VAE_TOP_CHANNELS * 4 * 6
    return MemoryPlan(_weight_bytes(config, weights, offload) * (1 if offload == "model" else experts),
                      self_cache, cross_cache * experts, activations, vae)


def _cached_bytes(head_dim: int, frame_tokens: int, cache_dtype: str) -> int:
    """Bytes per token and head of cached K (or V): fp8 codes plus the frame's scales (see ``kv_cache.quantized``)."""
    if cache_dtype == "fp8":
        return head_dim + _layout(frame_tokens)[1]
    return head_dim * CACHE_DTYPES[cache_dtype]


def _weight_bytes(config: dict, weights: str, offload: str) -> int:
    return _weight_bytes_of(json.dumps(config, sort_keys=True), weights, offload)


@functools.lru_cache(maxsize=32)  # building a 14B model, even on the meta device, takes a second
def _weight_bytes_of(config_json: str, weights: str, offload: str) -> int:
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**json.loads(config_json))
    keep_fp32 = tuple(model._keep_in_fp32_modules or ())
    block_total = [_module_bytes(block, weights, keep_fp32) for block in model.blocks]
    outside = sum(_param_bytes(name, p, weights, keep_fp32, quantized=False) for name, p in model.named_parameters()
                  if not name.startswith("blocks."))
    total = outside + (sum(block_total) if offload != "group" else 2 * max(block_total))
    return int(total)


def _module_bytes(block, weights, keep_fp32) -> float:
    return sum(_param_bytes(name, p, weights, keep_fp32, quantized=True) for name, p in block.named_parameters())


def _param_bytes(name: str, param, weights: str, keep_fp32, quantized: bool) -> float:
    if any(part in keep_fp32 for part in name.split(".")):
        return param.numel() * 4
    if quantized and param.ndim == 2:
        scales = param.shape[0] * 4 if weights in ("fp8", "int8") else 0
        return param.numel() * WEIGHT_FORMATS[weights] + scales
    return param.numel() * 2


def _config(model) -> tuple[dict, int]:
    if isinstance(model, dict):
        return {**_WAN, **model}, 1
    if model in PRESETS:
        return dict(PRESETS[model][0]), PRESETS[model][1]
    path = os.path.join(model, "config.json") if os.path.isdir(str(model)) else str(model)
    if not os.path.isfile(path):
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a transformer config.json "
                         "or a folder holding one; pass one of those.")
    with open(path) as file:
        values = json.load(file)
    return {**_WAN, **{k: v for k, v in values.items() if not k.startswith("_")}}, 1


def _check(weights, cache_dtype, compute_dtype, offload, height, width, chunk_frames, window_frames, sink_frames,
           context_parallel) -> None:
    if weights == "nvfp4":
        raise ValueError("weights='nvfp4' is not planned: no diffusers loader runs NVFP4 Wan weights (the converter "
                         "refuses them too); use the release's bf16 or fp8 weights, or weights='gguf-q4_k'.")
    for what, value, allowed in (("weights", weights, WEIGHT_FORMATS), ("cache_dtype", cache_dtype, CACHE_DTYPES),
                                 ("compute_dtype", compute_dtype, ("fp32", "bf16", "fp16")),
                                 ("offload", offload, OFFLOAD_MODES)):
        if value not in allowed:
            raise ValueError(f"{what}={value!r} is not a planned {what}; pass one of {', '.join(allowed)}.")
    if height % 16 or width % 16:
        raise ValueError(f"height and width must be multiples of 16 (8x VAE, 2x2 patches), got {height}x{width}.")
    if window_frames is not None and chunk_frames > window_frames - sink_frames:
        raise ValueError(f"chunk_frames={chunk_frames} does not fit next to the sink in window_frames={window_frames} "
                         f"with sink_frames={sink_frames}; pass window_frames >= chunk_frames + sink_frames.")
    if (height // 16) % context_parallel:
        raise ValueError(f"context_parallel={context_parallel} does not divide the {height // 16} post-patch rows; "
                         "pass a height whose rows it divides.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusers_causal_kv.memory_plan", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a transformer config.json / folder")
    for name, default in (("height", 480), ("width", 832), ("num-frames", 81), ("chunk-frames", 3),
                          ("window-frames", None), ("sink-frames", 0), ("batch-size", 1), ("context-parallel", 1),
                          ("experts", None)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--cache-dtype", default="bf16")
    parser.add_argument("--offload", default="none")
    parser.add_argument("--budget-gib", type=float, default=None)
    args = vars(parser.parse_args(argv))
    budget = args.pop("budget_gib")
    try:
        plan = memory_plan(args.pop("model"), **args)
    except ValueError as error:
        print(f"error: {error}")
        return 1
    print(plan.table())
    if budget is not None:
        print(f"{'fits' if plan.fits(budget * GIB) else 'does not fit'} in {budget:g} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
