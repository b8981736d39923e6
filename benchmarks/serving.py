"""Many live streams on one model: K sessions batched into one forward (``serve.step_streams``) against the same K
sessions run one after another (``batched=False``), measured side by side in one run.

For each K in ``--sessions`` (default 1 2 4 8), K streams of one ``CausalWanPipeline`` (each with its own prompt, seed
and rolling engines with relative positions, so every full window has the same shape) start together and run every
chunk, either stepped together by ``step_streams(streams)`` or each stream's chunk made in turn. The two modes
alternate (ABBA) over ``--repeats`` repeats, after a warm-up run of each; every number is the median over repeats.

Per mode and K, as a viewer of each session sees it (every session is requested at the start of the run):

* throughput: video frames per second over all sessions (all frames / time until the last chunk is handed out), and
  per second of this process's CPU time (on a CPU shared with other jobs the wall clock also measures how the system
  shares the cores: K worker threads get more of them than one thread does, so the CPU-time ratio is the one to
  trust there);
* time to first frame of each session (until its first chunk is handed out), median and worst over the sessions;
* per-chunk latency of each session: the time between two of its chunks, median over chunks and sessions;
* memory per session: the bytes of its KV cache (``memory_bytes()`` of its engines) and of the clean latents it keeps
  for re-caching, and on CUDA the peak device memory of the run;
* the largest difference between a session's latents in the two modes (batched rows against separate rows).

Ratios batched / one after another are printed beside the numbers. Streams output latents (the batching is the
transformer's; each stream decodes its own chunks either way).

    python benchmarks/serving.py                                  # the reduced shape on the CPU
    python benchmarks/serving.py --device cuda                    # Wan2.1-T2V-1.3B at 480x832, bf16 (needs a GPU)
    python benchmarks/serving.py --shape tiny --sessions 1 2 --repeats 1   # the test suite's smoke run

Prints a table, then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from diffusers_causal_kv import CausalConfig, CausalWanPipeline
from diffusers_causal_kv.serve import step_streams
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan

TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    ffn_dim: int
    text_dim: int
    text_len: int
    freq_dim: int
    height: int  # pixels (the VAE's spatial factor is 8: latent height / 8)
    width: int
    chunk_frames: int
    chunks: int  # chunks per session
    window_frames: int
    sink_frames: int
    steps: int
    dtype: str

    @property
    def latent_frames(self) -> int:
        return self.chunk_frames * self.chunks

    @property
    def num_frames(self) -> int:
        """Video frames of a stream (4x temporal compression; latent frame 0 is one frame)."""
        return 4 * (self.latent_frames - 1) + 1


SHAPES = {
    # Wan2.1-T2V-1.3B at 480x832 (1560 tokens per latent frame), chunks of 3 latent frames, 4 steps, a 12-frame window
    # with a 3-frame sink (full from the fourth chunk on), bf16.
    "wan-1.3b": Shape(layers=30, heads=12, head_dim=128, ffn_dim=8960, text_dim=4096, text_len=512, freq_dim=256,
                      height=480, width=832, chunk_frames=3, chunks=6, window_frames=12, sink_frames=3, steps=4,
                      dtype="bfloat16"),
    # The same code at a size a CPU runs in seconds.
    "reduced": Shape(layers=2, heads=2, head_dim=16, ffn_dim=64, text_dim=32, text_len=16, freq_dim=32, height=64,
                     width=64, chunk_frames=2, chunks=5, window_frames=6, sink_frames=1, steps=2, dtype="float32"),
    # The test suite's smoke run.
    "tiny": Shape(layers=1, heads=2, head_dim=8, ffn_dim=16, text_dim=32, text_len=8, freq_dim=32, height=32,
                  width=32, chunk_frames=2, chunks=3, window_frames=4, sink_frames=1, steps=2, dtype="float32"),
}
MODES = ("batched", "one after another")


def build_pipeline(shape: Shape, device: torch.device) -> CausalWanPipeline:
    dtype = getattr(torch, shape.dtype)
    transformer = tiny_wan(head_dim=shape.head_dim, heads=shape.heads, layers=shape.layers, ffn_dim=shape.ffn_dim,
                           text_dim=shape.text_dim, freq_dim=shape.freq_dim, rope_max_seq_len=1024, init="fan_in",
                           device=device, dtype=dtype)
    config = CausalConfig(chunk_frames=shape.chunk_frames, timesteps=TIMESTEPS[:shape.steps],
                          window_frames=shape.window_frames, sink_frames=shape.sink_frames, positions="relative")
    return CausalWanPipeline(**tiny_pipeline_components(transformer), causal_config=config).to(device)


def open_streams(pipe: CausalWanPipeline, shape: Shape, k: int, device: torch.device) -> list:
    """K streams, each with its own prompt embeddings, seed and engines."""
    streams = []
    for seed in range(k):
        embeds = torch.randn(1, shape.text_len, shape.text_dim, generator=torch.Generator().manual_seed(100 + seed))
        streams.append(pipe.stream(prompt_embeds=embeds.to(device, getattr(torch, shape.dtype)), height=shape.height,
                                   width=shape.width, num_frames=shape.num_frames, output_type="latent",
                                   generator=torch.Generator(device).manual_seed(seed)))
    return streams


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(pipe, shape: Shape, k: int, mode: str, device: torch.device) -> dict:
    """One run of K sessions: when each chunk of each session was handed out, and what the sessions hold."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    streams = open_streams(pipe, shape, k, device)
    ready: list[list[float]] = [[] for _ in streams]
    latents: list[list[torch.Tensor]] = [[] for _ in streams]
    frames = 0
    synchronize(device)
    began, cpu_began = time.perf_counter(), time.process_time()
    for _ in range(shape.chunks):
        if mode == "batched":
            made = step_streams(streams)
            now = time.perf_counter()  # every session's chunk is handed out when the step returns
            stamps = [now] * k
        else:
            made, stamps = [], []
            for stream in streams:
                made += step_streams([stream], batched=False)  # next(stream)
                stamps.append(time.perf_counter())
        for i, (chunk, stamp) in enumerate(zip(made, stamps)):
            if isinstance(chunk, BaseException):
                raise chunk
            ready[i].append(stamp - began)
            latents[i].append(chunk.latents)
            frames += len(chunk.video_frames)
    synchronize(device)
    result = {
        "ready": ready,
        "frames": frames,
        "cpu_seconds": time.process_time() - cpu_began,
        "cache_bytes": [sum(e.memory_bytes() for m in s.session.engine_maps() for e in m.values()) for s in streams],
        "session_bytes": [s.session.memory_bytes() for s in streams],
        "latents": [torch.cat(x, dim=2).float().cpu() for x in latents],
    }
    if device.type == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def summarise(runs: list[dict]) -> dict:
    """Medians over the repeats of one mode and K."""
    def median(values):
        return statistics.median(values)

    firsts = [[r[0] for r in run["ready"]] for run in runs]
    gaps = [[b - a for r in run["ready"] for a, b in zip(r, r[1:])] for run in runs]
    summary = {
        "video_frames_per_second": median([run["frames"] / max(max(r) for r in run["ready"]) for run in runs]),
        "time_to_first_frame_seconds": median([median(f) for f in firsts]),
        "worst_time_to_first_frame_seconds": median([max(f) for f in firsts]),
        "chunk_latency_seconds": median([median(g) for g in gaps]) if all(gaps) else None,
        "video_frames_per_cpu_second": median([run["frames"] / run["cpu_seconds"] for run in runs]),
        "cache_bytes_per_session": median([median(run["cache_bytes"]) for run in runs]),
        "session_bytes_per_session": median([median(run["session_bytes"]) for run in runs]),
    }
    if "peak_device_bytes" in runs[0]:
        summary["peak_device_bytes"] = median([run["peak_device_bytes"] for run in runs])
    return summary


def ratios(batched: dict, alone: dict) -> dict:
    """Batched / one after another, for every number both have."""
    return {name: batched[name] / alone[name] for name in batched
            if isinstance(batched[name], float | int) and alone.get(name)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="default: wan-1.3b with --device cuda, reduced on the CPU")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each mode (medians)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU: torch threads (default 1: on tiny shapes an OpenMP team costs more than the work, "
                             "and differently in the caller's thread and in the step's worker threads)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: --device cuda needs a GPU and none is available here; run on the CPU (the default) "
                       "or on a machine with a GPU.\n")
    shape_name = args.shape or ("wan-1.3b" if device.type == "cuda" else "reduced")
    shape = SHAPES[shape_name]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"serving benchmark: shape {shape_name}, device {gpu or 'cpu'}"
          + ("" if gpu else f" ({torch.get_num_threads()} thread(s); no GPU used: the wan-1.3b shape runs only with "
                            "--device cuda on a machine with a GPU)"))
    pipe = build_pipeline(shape, device)
    for mode in MODES:  # warm-up: allocator, kernels, first-call costs
        run(pipe, shape, min(args.sessions), mode, device)
    report = {"shape_name": shape_name, "shape": asdict(shape), "device": gpu or "cpu", "repeats": args.repeats,
              "date": datetime.date.today().isoformat(), "sessions": {}}
    for k in args.sessions:
        runs = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(run(pipe, shape, k, mode, device))
        rows = {mode: summarise(runs[mode]) for mode in MODES}
        difference = max((a - b).abs().max().item() for a, b in zip(runs["batched"][0]["latents"],
                                                                    runs["one after another"][0]["latents"]))
        report["sessions"][str(k)] = {**rows, "batched / one after another": ratios(*rows.values()),
                                      "max_abs_latent_difference": difference}
    print_table(report)
    print(json.dumps(report))
    return report


def print_table(report: dict) -> None:
    header = (f"{'K':>3} {'mode':<18} {'frames/s':>10} {'frames/CPU s':>12} {'TTFF s':>9} {'worst TTFF':>10} "
              f"{'chunk s':>9} {'cache MiB/session':>17}")
    print(header)
    for k, row in report["sessions"].items():
        for mode in (*MODES, "batched / one after another"):
            r = row[mode]
            latency = r["chunk_latency_seconds"]
            cache = r.get("cache_bytes_per_session")
            print(f"{k:>3} {mode[:18]:<18} {r['video_frames_per_second']:>10.3g} "
                  f"{r['video_frames_per_cpu_second']:>12.3g} "
                  f"{r['time_to_first_frame_seconds']:>9.3g} {r['worst_time_to_first_frame_seconds']:>10.3g} "
                  f"{'-' if latency is None else format(latency, '.3g'):>9} "
                  f"{'-' if cache is None else format(cache / 2**20 if mode in MODES else cache, '.3g'):>17}")
        print(f"{'':>3} max |batched - alone| latents: {row['max_abs_latent_difference']:.2e}")
    print("ratios are batched / one after another (frames/s: higher is better; times: lower is better)")


if __name__ == "__main__":
    sys.exit(main() and 0)
