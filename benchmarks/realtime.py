"""Real-time streaming numbers for ``benchmarks/rollout.py``: frames per second, time to first frame and per-chunk
latency of a causal stream, for each way of running it, measured side by side in one process.

The stream: a few-step rollout (``RolloutPlanner``: predict x0, re-noise, commit) over a ``RollingKVCacheEngine``
with a sink and relative positions (what an unbounded stream uses), each clean chunk decoded at once with
``StreamingVAEDecoder``. Rows (``MODES``):

* ``eager``; ``compiled`` (``compile_repeated_blocks``); ``compiled+graphs`` (the same with
  ``mode="reduce-overhead"``: CUDA graphs replay the steady-state step on a GPU with inductor; with any other backend
  or on a CPU the row runs the same code without graphs and says so in its ``cuda_graphs`` field);
* ``fp8 cache`` (``kv_dtype=torch.float8_e4m3fn``);
* ``cfg separate`` / ``cfg batched``: with classifier-free guidance, the two tags as two forwards or one batch.

Every row reports the latent-only and the decoded numbers of the same runs (the decode of a chunk is timed apart
from its denoising and commit): frames per second over the whole stream and in the steady state (chunks whose window
is full), time to first frame, per-chunk latency. Beside them stand the FLOPs of the same work, counted by
``torch.utils.flop_counter.FlopCounterMode`` on the eager model (matmuls, attention, convolutions), and the lower
bound on time they imply at the device's peak (a measured dense matmul rate, or ``--peak-tflops``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from diffusers import AutoencoderKLWan
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula, sdpa_flop_count

from diffusers_causal_kv import (
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    RolloutPlanner,
    StreamingVAEDecoder,
    chunk_schedule,
)
from diffusers_causal_kv.testing import tiny_vae, tiny_wan

# The CPU build's fused SDPA kernel has no FLOP formula in torch; it computes what the CUDA kernels compute.
_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
if _CPU_SDPA not in flop_registry:

    @register_flop_formula(_CPU_SDPA)
    def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)


@dataclass(frozen=True)
class StreamShape:
    layers: int
    heads: int
    head_dim: int
    ffn_dim: int
    frames: int  # latent frames of the stream
    height: int  # latent height and width (patch 1x2x2)
    width: int
    chunk: int
    window_frames: int
    sink_frames: int
    steps: int
    text_len: int
    text_dim: int
    freq_dim: int
    vae: str  # "wan2.1": the stock AutoencoderKLWan config (Wan2.1's VAE); "tiny": diffusers_causal_kv.testing's
    repeats: int
    guidance_scale: float = 3.0

    @property
    def schedule(self) -> list[int]:
        return chunk_schedule(self.frames, self.chunk)

    @property
    def chunk_slices(self) -> list[slice]:
        """Each chunk's latent frames."""
        ends = list(itertools.accumulate(self.schedule))
        return [slice(end - size, end) for end, size in zip(ends, self.schedule)]

    @property
    def steady_chunks(self) -> list[int]:
        """The chunks that attend over a full window (the same shapes every chunk)."""
        return [k for k, c in enumerate(self.chunk_slices) if c.stop >= self.window_frames]


SHAPES = {
    # Wan2.1-T2V-1.3B at 480x832: 1560 tokens per latent frame; 30 latent frames (117 video frames) in chunks of 3
    # over a window of 16 frames with a 3-frame sink, so the last 5 chunks run in the steady state.
    "wan-1.3b": StreamShape(layers=30, heads=12, head_dim=128, ffn_dim=8960, frames=30, height=60, width=104, chunk=3,
                            window_frames=16, sink_frames=3, steps=4, text_len=512, text_dim=4096, freq_dim=256,
                            vae="wan2.1", repeats=3),
    # The same code at a size a CPU runs in seconds (the test suite runs it).
    "reduced": StreamShape(layers=2, heads=2, head_dim=16, ffn_dim=64, frames=10, height=8, width=8, chunk=2,
                           window_frames=6, sink_frames=1, steps=2, text_len=8, text_dim=32, freq_dim=32, vae="tiny",
                           repeats=1),
}


@dataclass(frozen=True)
class Mode:
    name: str
    compiled: bool = False
    graphs: bool = False
    kv_dtype: torch.dtype | None = None
    cfg: str | None = None  # None (no guidance), "separate" or "batched"


MODES = (
    Mode("eager"),
    Mode("compiled", compiled=True),
    Mode("compiled+graphs", compiled=True, graphs=True),
    Mode("fp8 cache", kv_dtype=torch.float8_e4m3fn),
    Mode("cfg separate", cfg="separate"),
    Mode("cfg batched", cfg="batched"),
)
SIGMAS = (1.0, 0.75, 0.5, 0.25)
IN_CHANNELS = 16


def build_transformer(shape: StreamShape, device, dtype) -> torch.nn.Module:
    model = tiny_wan(head_dim=shape.head_dim, heads=shape.heads, layers=shape.layers, seed=0, rope_max_seq_len=1024,
                     in_channels=IN_CHANNELS, out_channels=IN_CHANNELS, text_dim=shape.text_dim,
                     freq_dim=shape.freq_dim, ffn_dim=shape.ffn_dim, init="fan_in", device=device, dtype=dtype)
    model.requires_grad_(False).set_attn_processor(CausalWanAttnProcessor())
    return model


def build_vae(shape: StreamShape, device) -> AutoencoderKLWan:
    """In float32, as the stock Wan pipelines run their VAE (the decoder casts the latents)."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan() if shape.vae == "wan2.1" else tiny_vae(seed=0)
    return vae.to(device).requires_grad_(False)


def make_inputs(shape: StreamShape, device, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, IN_CHANNELS, shape.frames, shape.height, shape.width, generator=g)
    prompt, negative = (torch.randn(1, shape.text_len, shape.text_dim, generator=g) for _ in range(2))
    return {"noise": noise.to(device), "prompt": prompt.to(device, dtype), "negative": negative.to(device, dtype)}


def video_frames(schedule: list[int]) -> list[int]:
    """Video frames each chunk decodes to (Wan's 4x temporal compression; the first latent frame is one frame)."""
    return [4 * size - (3 if k == 0 else 0) for k, size in enumerate(schedule)]


class Runner:
    """One row: its transformer (compiled or not), its engine map, its planner settings."""

    def __init__(self, mode: Mode, transformer, shape: StreamShape, inputs: dict):
        self.mode, self.transformer, self.shape, self.inputs = mode, transformer, shape, inputs
        self.engines = {"main": RollingKVCacheEngine(shape.window_frames, sink_frames=shape.sink_frames,
                                                     positions="relative", kv_dtype=mode.kv_dtype)}

    def planner(self) -> RolloutPlanner:
        guided = self.mode.cfg is not None
        return RolloutPlanner(
            self.transformer, self.inputs["prompt"], negative_prompt_embeds=self.inputs["negative"] if guided else None,
            guidance_scale=self.shape.guidance_scale if guided else 1.0, cache_engines=self.engines,
            generator=torch.Generator(self.inputs["noise"].device).manual_seed(1),
            cfg_batch=self.mode.cfg != "separate")

    @torch.no_grad()
    def stream(self, decoder: StreamingVAEDecoder | None) -> dict:
        """One stream from an empty cache: per chunk the seconds to its committed latents and to decode them."""
        noise, sigmas = self.inputs["noise"], list(SIGMAS[: self.shape.steps])
        planner = self.planner()
        chunks = planner.plan(noise, self.shape.chunk)
        planner.check(noise, chunks)
        planner.clear()
        if decoder is not None:
            decoder.reset()
        latent_seconds, denoise_seconds, decode_seconds, latents = [], [], [], []
        for chunk in chunks:
            synchronize(noise.device)
            began = time.perf_counter()
            x = noise[:, :, chunk.offset:chunk.offset + chunk.size]
            for i, sigma in enumerate(sigmas):
                x0 = planner.predict_x0(x, sigma, chunk)
                x = planner.renoise(x0, sigmas[i + 1]) if i + 1 < len(sigmas) else x0
            synchronize(noise.device)
            denoise_seconds.append(time.perf_counter() - began)  # the chunk's frames exist; its commit follows
            planner.commit(x, chunk)
            synchronize(noise.device)
            committed = time.perf_counter()
            if decoder is not None:
                decoder.decode(x)
                synchronize(noise.device)
            latent_seconds.append(committed - began)
            decode_seconds.append(time.perf_counter() - committed)
            latents.append(x)
        return {"latent": latent_seconds, "denoise": denoise_seconds, "decode": decode_seconds,
                "latents": torch.cat(latents, dim=2)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compile_transformer(model, backend: str, graphs: bool) -> dict:
    """Compile the blocks; returns the compile settings actually used."""
    cuda_graphs = graphs and backend == "inductor" and model.device.type == "cuda"
    # Graphs are specialised per block, kind of pass and window fill state (README, Performance). Past the limits
    # Dynamo would run the rest eagerly without a word.
    limit = 64 * len(model.blocks)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, limit)
    kwargs = {"mode": "reduce-overhead"} if cuda_graphs else {}
    model.compile_repeated_blocks(backend=backend, **kwargs)
    if cuda_graphs:  # each transformer forward is one step of the graph trees (its outputs outlive the next one)
        model.register_forward_pre_hook(lambda *_: torch.compiler.cudagraph_mark_step_begin())
    return {"backend": backend, "cuda_graphs": cuda_graphs}


def peak_flops_per_second(device: torch.device, dtype: torch.dtype) -> float:
    """The dense matmul rate this device reaches here (median of repeats): the peak the FLOP bound divides by."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    rates = []
    for _ in range(6):
        synchronize(device)
        began = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(device)
        rates.append(4 * 2 * n**3 / (time.perf_counter() - began))
    return statistics.median(rates[1:])


@torch.no_grad()
def count_flops(run) -> int:
    """FLOPs of ``run()`` (matmuls, attention, convolutions)."""
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def decode_stream(decoder: StreamingVAEDecoder, shape: StreamShape, latents: torch.Tensor) -> None:
    decoder.reset()
    for chunk in shape.chunk_slices:
        decoder.decode(latents[:, :, chunk])


def summarise(shape: StreamShape, runs: list[dict]) -> dict:
    """Medians over the repeats, per chunk, and the stream's rates."""
    latent = [statistics.median(c) for c in zip(*(r["latent"] for r in runs))]
    decode = [statistics.median(c) for c in zip(*(r["decode"] for r in runs))]
    # The first frames exist once chunk 0 is denoised (its commit pass can run while they are shown).
    first_denoised = statistics.median(r["denoise"][0] for r in runs)
    frames = video_frames(shape.schedule)
    steady = shape.steady_chunks
    with_decode = [lat + dec for lat, dec in zip(latent, decode)]
    return {
        "chunk_latency_seconds": latent,
        "chunk_decode_seconds": decode,
        "time_to_first_frame_seconds": first_denoised,
        "time_to_first_frame_with_decode_seconds": first_denoised + decode[0],
        "video_frames_per_second": sum(frames) / sum(latent),
        "video_frames_per_second_with_decode": sum(frames) / sum(with_decode),
        "steady_video_frames_per_second": sum(frames[k] for k in steady) / sum(latent[k] for k in steady),
        "steady_video_frames_per_second_with_decode":
            sum(frames[k] for k in steady) / sum(with_decode[k] for k in steady),
        "steady_chunk_latency_seconds": statistics.median(latent[k] for k in steady),
    }


def measure_realtime(shape_name: str, device: str, dtype: torch.dtype, backend: str, repeats: int | None = None,
                     peak_tflops: float | None = None) -> dict:
    """Every row of ``MODES`` on the shape ``shape_name``, interleaved (alternating order), medians of repeats."""
    shape = SHAPES[shape_name]
    repeats = shape.repeats if repeats is None else repeats
    device = torch.device(device)
    inputs = make_inputs(shape, device, dtype)
    eager = build_transformer(shape, device, dtype)
    decoder = StreamingVAEDecoder(build_vae(shape, device))
    runners, settings = [], {}
    for mode in MODES:
        model = eager
        if mode.compiled:
            model = build_transformer(shape, device, dtype)  # same seed, same weights; compiled in place
            settings[mode.name] = compile_transformer(model, backend, mode.graphs)
        runners.append(Runner(mode, model, shape, inputs))

    warmup, graphs, memory, outputs = {}, {}, {}, {}
    for runner in runners:  # the first stream compiles (compiled rows); its outputs are compared below
        name = runner.mode.name
        graphs_before = counters["stats"]["unique_graphs"]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        outputs[name] = runner.stream(decoder)["latents"]
        warmup[name] = time.perf_counter() - began
        graphs[name] = counters["stats"]["unique_graphs"] - graphs_before
        memory[name] = {"engine_memory_bytes": runner.engines["main"].memory_bytes(),
                        **({"peak_cuda_memory_bytes": torch.cuda.max_memory_allocated()} if device.type == "cuda"
                           else {})}
    runs = {runner.mode.name: [] for runner in runners}
    recompiles = dict.fromkeys(runs, 0)
    for r in range(repeats):
        for runner in runners if r % 2 == 0 else runners[::-1]:
            graphs_before = counters["stats"]["unique_graphs"]
            runs[runner.mode.name].append(runner.stream(decoder))
            recompiles[runner.mode.name] += counters["stats"]["unique_graphs"] - graphs_before

    # On the eager model: the stream without and with guidance, and the decode (the same for every row).
    by_name = {runner.mode.name: runner for runner in runners}
    flops = {guided: count_flops(lambda name=name: by_name[name].stream(None))
             for guided, name in ((False, "eager"), (True, "cfg batched"))}
    decode_flops = count_flops(lambda: decode_stream(decoder, shape, outputs["eager"]))
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops_per_second(device, dtype)
    total_frames = sum(video_frames(shape.schedule))
    rows = {}
    for runner in runners:
        mode, name = runner.mode, runner.mode.name
        work = flops[bool(mode.cfg)]
        bound = work / peak
        bound_decoded = (work + decode_flops) / peak
        reference = outputs["cfg separate" if mode.cfg else "eager"]
        rows[name] = {
            **summarise(shape, runs[name]),
            "first_stream_seconds": warmup[name],
            **memory[name],
            "compile": settings.get(name),
            "graphs_compiled_first_stream": graphs[name] if mode.compiled else 0,
            "recompiles_after_first_stream": recompiles[name],
            "flops": work,
            "decode_flops": decode_flops,
            "flop_lower_bound_seconds": bound,
            "flop_lower_bound_with_decode_seconds": bound_decoded,
            "flop_bound_video_frames_per_second": total_frames / bound,
            "flop_bound_video_frames_per_second_with_decode": total_frames / bound_decoded,
            "reference": "cfg separate" if mode.cfg else "eager",
            "max_abs_diff_vs_reference": (outputs[name].float() - reference.float()).abs().max().item(),
        }
    return {
        "shape_name": shape_name,
        "shape": asdict(shape),
        "chunk_sizes": shape.schedule,
        "steady_chunks": shape.steady_chunks,
        "video_frames": total_frames,
        "dtype": str(dtype).removeprefix("torch."),
        "vae_dtype": "float32",
        "repeats": repeats,
        "compile_backend": backend,
        "peak_flops_per_second": peak,
        "peak_source": "given (--peak-tflops)" if peak_tflops else "measured dense matmul",
        # graphs inductor declined to capture (it logs each reason); 0 when none, or when nothing ran under graphs
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        # frames Dynamo tried to compile and left eager (a recompile limit hit, an error): should be 0
        "frames_not_compiled": counters["frames"]["total"] - counters["frames"]["ok"],
        "rows": rows,
        # side by side in the same interleaved runs
        "cfg_batched_vs_separate_ratio": sum(rows["cfg batched"]["chunk_latency_seconds"])
        / sum(rows["cfg separate"]["chunk_latency_seconds"]),
    }


def print_realtime(report: dict) -> None:
    shape = report["shape"]
    print(f"\nreal-time stream, shape {report['shape_name']}: {shape['layers']} layers, "
          f"{shape['heads']}x{shape['head_dim']} heads, latent {shape['height']}x{shape['width']}, "
          f"{shape['frames']} latent frames ({report['video_frames']} video frames) in chunks {report['chunk_sizes']}, "
          f"{shape['steps']} steps, rolling window {shape['window_frames']} (sink {shape['sink_frames']}), "
          f"{report['dtype']}, VAE {shape['vae']} in {report['vae_dtype']}; medians of {report['repeats']} interleaved "
          f"repeats; steady chunks "
          f"{report['steady_chunks']}")
    print(f"FLOP bound at {report['peak_flops_per_second'] / 1e12:.2f} TFLOP/s ({report['peak_source']})\n")
    header = (f"{'mode':<17}{'fps':>8}{'fps+dec':>9}{'steady':>8}{'st+dec':>8}{'TTFF s':>9}{'TTFF+dec':>10}"
              f"{'chunk s':>9}{'bound fps':>11}{'bound+dec':>11}{'cache MiB':>11}")
    print(header)
    print("-" * len(header))
    for name, row in report["rows"].items():
        print(f"{name:<17}{row['video_frames_per_second']:>8.2f}{row['video_frames_per_second_with_decode']:>9.2f}"
              f"{row['steady_video_frames_per_second']:>8.2f}{row['steady_video_frames_per_second_with_decode']:>8.2f}"
              f"{row['time_to_first_frame_seconds']:>9.3f}{row['time_to_first_frame_with_decode_seconds']:>10.3f}"
              f"{row['steady_chunk_latency_seconds']:>9.3f}{row['flop_bound_video_frames_per_second']:>11.1f}"
              f"{row['flop_bound_video_frames_per_second_with_decode']:>11.1f}"
              f"{row['engine_memory_bytes'] / 2**20:>11.2f}")
    rows = report["rows"]
    print(f"batched / separate CFG stream time: {report['cfg_batched_vs_separate_ratio']:.3f}x"
          f"; graphs row uses CUDA graphs: {rows['compiled+graphs']['compile']['cuda_graphs']} "
          f"({report['cudagraph_skips']} skipped); frames left eager {report['frames_not_compiled']}; recompiles "
          "after the "
          "first stream: " + ", ".join(f"{n} {r['recompiles_after_first_stream']}" for n, r in rows.items()
                                       if r["compile"]))
