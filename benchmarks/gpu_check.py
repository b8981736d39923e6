"""Everything this package can only measure on a GPU, in one command (under 8 minutes on one H200), one table:

* the real-time rows of ``benchmarks/realtime.py`` on the Wan2.1-1.3B stream shape (eager, compiled, compiled with
  CUDA graphs, the fp8 cache, guidance separate and batched): steady-state frames per second and peak CUDA memory;
* quantized weights on a Wan2.1-1.3B-shaped transformer of ``--layers`` blocks: weight memory and the median time of
  one chunk forward for bf16, torchao int8 and float8 weight-only and bitsandbytes 8-bit (the cached rollout of each
  CPU route against the masked full-sequence forward of the same quantized model is in
  ``tests/test_quantized_weights.py``);
* the memory plan against ``torch.cuda.max_memory_allocated`` for one cached chunk forward of that transformer.

``python benchmarks/gpu_check.py``; on a machine without CUDA it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import diffusers_causal_kv  # noqa: F401  (first: diffusers' optional backends imported without their log noise)


def _table(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(name) for name, _, _ in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")


def _realtime_rows() -> list[tuple[str, str, str]]:
    sys.path.insert(0, "benchmarks")
    from realtime import measure_realtime

    report = measure_realtime("wan-1.3b", "cuda", torch.bfloat16, "inductor", repeats=3)
    rows = []
    for name, row in report["rows"].items():
        rows.append((f"realtime {name}", f"{row['steady_video_frames_per_second_with_decode']:.2f} fps",
                     f"steady, decoded; peak {row['peak_cuda_memory_bytes'] / 2**30:.2f} GiB"))
    return rows


def _model(layers: int):
    from diffusers import WanTransformer3DModel

    from diffusers_causal_kv.memory_plan import PRESETS

    config = {**PRESETS["wan2.1-1.3b"][0], "num_layers": layers}
    torch.manual_seed(0)
    return WanTransformer3DModel(**config).to(torch.bfloat16).eval(), config


def _chunk_inputs(frames: int = 3):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, 16, frames, 60, 104, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, text


def _cached_chunk(model, x, text, start: int):
    from diffusers_causal_kv import CausalContext

    with torch.no_grad(), CausalContext(model, start_frame=start, store_kv=True):
        model(hidden_states=x, timestep=torch.zeros(1, device="cuda"), encoder_hidden_states=text, return_dict=False)


def _quantized_rows(layers: int, routes: list[str]) -> list[tuple[str, str, str]]:
    from diffusers_causal_kv import CausalWanAttnProcessor, clear_caches

    rows = []
    x, text = _chunk_inputs()
    for route in routes:
        model, _ = _model(layers)
        before = torch.cuda.memory_allocated()
        model = _quantize(model, route).cuda()
        weights = torch.cuda.memory_allocated() - before
        model.set_attn_processor(CausalWanAttnProcessor())
        times = []
        for _ in range(5):
            clear_caches(model)
            torch.cuda.synchronize()
            began = time.perf_counter()
            _cached_chunk(model, x, text, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        forward_ms = statistics.median(times) * 1e3
        rows.append((f"weights {route}", f"{weights / 2**30:.3f} GiB", f"chunk forward {forward_ms:.1f} ms"))
        del model
        torch.cuda.empty_cache()
    return rows


def _quantize(model, route: str):
    if route == "bf16":
        return model
    if route == "bitsandbytes-int8":
        import bitsandbytes  # noqa: F401  (the route needs it; an ImportError names the package)
        from diffusers import BitsAndBytesConfig, WanTransformer3DModel

        path = "/tmp/gpu_check_model"
        model.save_pretrained(path)
        return WanTransformer3DModel.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                     torch_dtype=torch.bfloat16)
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    quantize_(model.cuda(), {"torchao-int8": Int8WeightOnlyConfig, "torchao-float8": Float8WeightOnlyConfig}[route]())
    return model


def _plan_rows(layers: int) -> list[tuple[str, str, str]]:
    from diffusers_causal_kv import CausalWanAttnProcessor
    from diffusers_causal_kv.memory_plan import memory_plan

    model, config = _model(layers)
    model = model.cuda()
    model.set_attn_processor(CausalWanAttnProcessor())
    x, text = _chunk_inputs()
    _cached_chunk(model, x, text, 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _cached_chunk(model, x, text, 3)
    measured = torch.cuda.max_memory_allocated()
    plan = memory_plan(config, height=480, width=832, num_frames=4 * 5 + 1, chunk_frames=3)
    planned = plan.weights + plan.self_cache + plan.cross_cache + plan.activations
    return [("plan vs max_memory_allocated", f"{planned / measured:.3f}x",
             f"planned {planned / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB (second chunk of 3 frames)")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="blocks of the 1.3B-shaped transformer")
    parser.add_argument("--skip-realtime", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to measure (run it on a machine with a GPU).")
        return 0
    rows = []
    checks = [("plan", lambda: _plan_rows(args.layers)),
              ("quantized", lambda: _quantized_rows(args.layers, ["bf16", "torchao-int8", "torchao-float8",
                                                                  "bitsandbytes-int8"]))]
    if not args.skip_realtime:
        checks.append(("realtime", _realtime_rows))
    for name, check in checks:
        try:
            rows += check()
        except Exception as error:  # one failing check is a row of the table, the others still run
            rows.append((name, "failed", f"{type(error).__name__}: {error}"))
    print(f"gpu_check on {torch.cuda.get_device_name()}")
    _table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
