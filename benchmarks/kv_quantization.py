"""fp8 KV cache: its memory and the error it introduces, next to the error of bf16, measured side by side in one run.

Four rollouts of ``benchmarks/rollout.py``'s few-step causal sampler on one preset (same weights, noise and prompt;
every run follows its own trajectory, as a user's rollout would):

* ``fp32``: model and cache in fp32, the reference;
* ``bf16``: model and cache in bf16;
* ``bf16 + fp8 cache``: the bf16 model with ``kv_dtype=torch.float8_e4m3fn``;
* ``fp32 + fp8 cache``: the fp32 model with the fp8 cache (the quantization alone).

For each pair it prints the max and mean absolute difference of the flow outputs (every denoising forward of the
rollout) and of the final latents, with the mean magnitude of the reference's for scale, and the engines'
``memory_bytes()`` (self and cross entries) against the analytic size.

    python benchmarks/kv_quantization.py --size small [--engine vanilla|static|rolling] [--device cuda]

Prints a table, then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import PRESETS, SIGMAS, Cached, Preset, build_model, make_inputs, run_rollout  # noqa: E402

from diffusers_causal_kv import (  # noqa: E402
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
)
from diffusers_causal_kv.kv_cache.quantized import GROUP_TOKENS  # noqa: E402

FP8 = torch.float8_e4m3fn
TARGET_MEMORY_RATIO = 0.55  # fp8 / bf16 memory_bytes()
# (name, model dtype, kv_dtype)
RUNS = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("bf16 + fp8 cache", torch.bfloat16, FP8),
        ("fp32 + fp8 cache", torch.float32, FP8)]
# (what is measured, run, reference run)
COMPARISONS = [("bf16 vs fp32", "bf16", "fp32"), ("fp8 cache vs bf16 cache (bf16 model)", "bf16 + fp8 cache", "bf16"),
               ("fp8 cache vs fp32 cache (fp32 model)", "fp32 + fp8 cache", "fp32")]


class Recording(Cached):
    """The plugin's rollout, keeping every flow output."""

    def reset(self):
        super().reset()
        self.flows = []

    def denoise(self, x, t, start):
        flow = super().denoise(x, t, start)
        self.flows.append(flow)
        return flow


def make_engine(kind: str, preset: Preset, kv_dtype):
    if kind == "static":
        return StaticKVCacheEngine(max_frames=preset.frames, kv_dtype=kv_dtype)
    if kind == "rolling":
        return RollingKVCacheEngine(window_frames=2 * preset.chunk, sink_frames=1, kv_dtype=kv_dtype)
    return VanillaKVCacheEngine(kv_dtype=kv_dtype)


def held_frames(engine, preset: Preset) -> int:
    """Frames of self K/V an engine holds storage for after the rollout."""
    if isinstance(engine, StaticKVCacheEngine):
        return engine.max_frames
    if isinstance(engine, RollingKVCacheEngine):
        return engine.window_frames - 1
    return preset.frames


def analytic_memory_bytes(preset: Preset, engine, element_size: int | None) -> int:
    """Per block: K and V of the held frames' tokens and of the text tokens, ``batch x heads x bytes per token and
    head``: ``head_dim x element size``, or in fp8 (``element_size=None``) ``head_dim`` code bytes plus the bytes
    holding the scales (one float32 per group of GROUP_TOKENS tokens of a frame, or of the text)."""
    def per_token(frame_tokens):
        if element_size is not None:
            return preset.head_dim * element_size
        return preset.head_dim + math.ceil(4 * math.ceil(frame_tokens / GROUP_TOKENS) / frame_tokens)

    tokens = held_frames(engine, preset) * preset.frame_tokens
    per_block = tokens * per_token(preset.frame_tokens) + preset.text_len * per_token(preset.text_len)
    return preset.layers * len(engine.tags()) * 2 * preset.batch * preset.heads * per_block


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    diffs = torch.cat([(x.float() - y.float()).abs().flatten() for x, y in zip(a, b)])
    return {"max_abs": diffs.max().item(), "mean_abs": diffs.mean().item(),
            "reference_mean_abs": torch.cat([y.float().abs().flatten() for y in b]).mean().item()}


def measure(preset: Preset, engine_kind: str, device: str) -> dict:
    sigmas = list(SIGMAS[: preset.steps])
    runs = {}
    for name, dtype, kv_dtype in RUNS:
        model = build_model(preset, device, dtype)
        noise, renoise, text = make_inputs(preset, device, dtype)
        model.set_attn_processor(CausalWanAttnProcessor())
        variant = Recording(name, model, text, make_engine(engine_kind, preset, kv_dtype))
        latents, _ = run_rollout(variant, noise, renoise, sigmas)
        element_size = None if kv_dtype is not None else torch.tensor([], dtype=dtype).element_size()
        runs[name] = {"latents": latents, "flows": variant.flows, "memory_bytes": variant.engine.memory_bytes(),
                      "memory_bytes_analytic": analytic_memory_bytes(preset, variant.engine, element_size)}
    errors = {
        label: {"flow": difference(runs[run]["flows"], runs[ref]["flows"]),
                "final_latents": difference([runs[run]["latents"]], [runs[ref]["latents"]])}
        for label, run, ref in COMPARISONS
    }
    memory = {name: r["memory_bytes"] for name, r in runs.items()}
    return {
        "memory_bytes": memory,
        "memory_bytes_analytic": {name: r["memory_bytes_analytic"] for name, r in runs.items()},
        "memory_bytes_match": all(r["memory_bytes"] == r["memory_bytes_analytic"] for r in runs.values()),
        "fp8_vs_bf16_memory_ratio": memory["bf16 + fp8 cache"] / memory["bf16"],
        "errors": errors,
    }


def print_table(report: dict) -> None:
    c = report["config"]
    print(f"\nfp8 KV cache: preset {report['preset']} ({c['layers']} layers, {c['heads']} heads x {c['head_dim']}, "
          f"{c['frames']} latent frames of {report['frame_tokens']} tokens in chunks of {c['chunk']}, {c['steps']} "
          f"steps, text {c['text_len']} tokens), {report['engine']} engine on {report['device']}\n")
    header = f"{'run':<20}{'memory_bytes()':>16}{'analytic':>14}{'vs bf16':>10}"
    print(header)
    print("-" * len(header))
    for name, value in report["memory_bytes"].items():
        print(f"{name:<20}{value:>16}{report['memory_bytes_analytic'][name]:>14}"
              f"{value / report['memory_bytes']['bf16']:>9.3f}x")
    ratio = report["fp8_vs_bf16_memory_ratio"]
    print(f"\nfp8 / bf16 memory {ratio:.3f}x (target <= {TARGET_MEMORY_RATIO}: "
          f"{'met' if ratio <= TARGET_MEMORY_RATIO else 'missed'}); memory_bytes() == analytic: "
          f"{report['memory_bytes_match']}\n")
    header = (f"{'error':<40}{'flow max':>10}{'flow mean':>11}{'(|ref| mean)':>13}{'latents max':>13}"
              f"{'latents mean':>14}{'(|ref| mean)':>13}")
    print(header)
    print("-" * len(header))
    for label, e in report["errors"].items():
        f, lat = e["flow"], e["final_latents"]
        print(f"{label:<40}{f['max_abs']:>10.2e}{f['mean_abs']:>11.2e}{f['reference_mean_abs']:>13.2e}"
              f"{lat['max_abs']:>13.2e}{lat['mean_abs']:>14.2e}{lat['reference_mean_abs']:>13.2e}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(PRESETS), default="small")
    parser.add_argument("--engine", choices=["vanilla", "static", "rolling"], default="vanilla")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False.")
    preset = PRESETS[args.size]
    report = {"preset": args.size, "engine": args.engine, "device": args.device, "torch": torch.__version__,
              "config": {k: getattr(preset, k) for k in ("layers", "heads", "head_dim", "frames", "chunk", "steps",
                                                          "text_len", "batch")},
              "frame_tokens": preset.frame_tokens, "group_tokens": GROUP_TOKENS, "kv_dtype": str(FP8),
              **measure(preset, args.engine, args.device), "target_memory_ratio": TARGET_MEMORY_RATIO}
    print_table(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
