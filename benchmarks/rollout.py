"""Causal rollout benchmark: every variant measured side by side in one process, interleaved and repeated.

Variants of one few-step causal rollout (same weights, noise and sampler; outputs agree to float tolerance):

* ``cached-vanilla`` / ``cached-static``: the plugin, with the vanilla or the static engine;
* ``ideal``: a bare processor handed the prefix K/V as ready tensors (one preallocated buffer per block, the chunk
  written after the prefix, text K/V projected once): the cost no cache can avoid, without any context, hook,
  validation or engine bookkeeping;
* ``no-cache``: the alternative without a cache: every denoising forward re-runs the committed prefix with stock
  processors, a block-causal mask and per-token timesteps (0 for the prefix).

Also measured: processors installed but no context vs stock processors on one bidirectional forward, the engines'
``memory_bytes()`` against the analytic size, the peak process memory, the FLOP-predicted no-cache/cached ratio,
and with ``--compile`` the graph breaks and recompiles of a rollout over compiled blocks. With ``--device cuda`` it
adds frames per second and per-chunk latency at the Wan2.1-1.3B shape (random weights, bf16).

    python benchmarks/rollout.py --size small --device cpu [--dtype float32] [--plot chunks.png] [--compile]

Prints a table, then one JSON line with every number. ``--size tiny`` is a smoke test (CI runs it): its timings
cannot judge the targets, and the output says so; use ``--size small`` or larger for the numbers.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
    chunk_schedule,
)
from diffusers_causal_kv.rotary import apply_rotary_emb, rope_for_frames
from diffusers_causal_kv.testing import MaskedStockProcessor, tiny_wan

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this script is loaded
from realtime import SHAPES, measure_realtime, print_realtime  # noqa: E402


@dataclass(frozen=True)
class Preset:
    layers: int
    heads: int
    head_dim: int
    ffn_dim: int
    frames: int  # latent frames
    height: int  # latent height and width (patch 1x2x2)
    width: int
    chunk: int
    steps: int
    text_len: int
    text_dim: int
    freq_dim: int = 32
    batch: int = 1
    repeats: int = 3

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def frame_tokens(self) -> int:
        return (self.height // 2) * (self.width // 2)


PRESETS = {
    "tiny": Preset(layers=2, heads=2, head_dim=12, ffn_dim=48, frames=5, height=8, width=8, chunk=2, steps=2,
                   text_len=12, text_dim=32, repeats=1),
    "small": Preset(layers=4, heads=4, head_dim=64, ffn_dim=1024, frames=9, height=16, width=16, chunk=3, steps=4,
                    text_len=64, text_dim=256, repeats=3),
    "medium": Preset(layers=8, heads=8, head_dim=64, ffn_dim=2048, frames=12, height=32, width=32, chunk=3, steps=4,
                     text_len=128, text_dim=512, repeats=3),
}
SIGMAS = (1.0, 0.75, 0.5, 0.25)  # few-step schedule, truncated to the preset's steps
IN_CHANNELS = 16
TARGETS = {"static_vs_ideal": 1.05, "installed_no_context_vs_stock": 1.02}
# Presets too small to judge the targets: their forwards take well under a millisecond, so fixed Python costs and
# timer noise decide the ratios (they only check that the script and every variant run).
SMOKE_PRESETS = {"tiny"}


# ---------------------------------------------------------------------------------------------------- model
def build_model(preset: Preset, device: str, dtype: torch.dtype, seed: int = 0) -> WanTransformer3DModel:
    """Random weights everywhere (the zero-initialised output layers too), scaled by fan-in."""
    return tiny_wan(
        head_dim=preset.head_dim, heads=preset.heads, layers=preset.layers, seed=seed, rope_max_seq_len=1024,
        in_channels=IN_CHANNELS, out_channels=IN_CHANNELS, text_dim=preset.text_dim, freq_dim=preset.freq_dim,
        ffn_dim=preset.ffn_dim, init="fan_in", device=device, dtype=dtype,
    ).requires_grad_(False)


# ---------------------------------------------------------------------------------------------------- variants
class Variant:
    """One way of running the rollout: ``denoise`` returns the flow of a chunk, ``commit`` stores a clean chunk."""

    name: str

    def reset(self) -> None: ...

    def denoise(self, x, t: float, start: int): ...

    def commit(self, x, start: int) -> None: ...


class Cached(Variant):
    """The plugin: CausalContext over a per-session engine map."""

    def __init__(self, name, model, text, engine):
        self.name, self.model, self.text, self.engine = name, model, text, engine
        self.engines = {"main": engine}

    def reset(self):
        self.engine.clear()

    def _forward(self, x, t, start, store_kv):
        timestep = torch.full((x.shape[0],), float(t), device=x.device)
        with CausalContext(self.model, start_frame=start, store_kv=store_kv, cache_engines=self.engines):
            return self.model(hidden_states=x, timestep=timestep, encoder_hidden_states=self.text,
                              return_dict=False)[0]

    def denoise(self, x, t, start):
        return self._forward(x, t, start, False)

    def commit(self, x, start):
        self._forward(x, 0.0, start, True)


class NoCache(Variant):
    """Recompute: each denoising forward runs ``[committed prefix | chunk]`` with a block-causal mask."""

    name = "no-cache"

    def __init__(self, model, text, preset: Preset):
        self.model, self.text, self.preset = model, text, preset
        self.processor = MaskedStockProcessor()  # its mask is set per forward
        model.set_attn_processor(self.processor)

    def reset(self):
        self.committed = []

    def denoise(self, x, t, start):
        ft = self.preset.frame_tokens
        x_all = torch.cat([*self.committed, x], dim=2)
        prefix_tokens, chunk_tokens = start * ft, x.shape[2] * ft
        chunk_of_token = torch.cat([
            torch.arange(len(self.committed), device=x.device).repeat_interleave(
                torch.tensor([c.shape[2] * ft for c in self.committed], device=x.device, dtype=torch.long))
            if self.committed else torch.zeros(0, dtype=torch.long, device=x.device),
            torch.full((chunk_tokens,), len(self.committed), device=x.device, dtype=torch.long),
        ])
        self.processor.mask = chunk_of_token[None, :] <= chunk_of_token[:, None]
        timestep = torch.cat([torch.zeros(x.shape[0], prefix_tokens, device=x.device),
                              torch.full((x.shape[0], chunk_tokens), float(t), device=x.device)], dim=1)
        out = self.model(hidden_states=x_all, timestep=timestep, encoder_hidden_states=self.text, return_dict=False)[0]
        return out[:, :, start:]

    def commit(self, x, start):
        self.committed.append(x)


class IdealState:
    def __init__(self):
        self.length = 0  # committed tokens
        self.store = False
        self.rope = None


class IdealSelfProcessor:
    """Self-attention over a ready buffer: the chunk's K/V written after the prefix, one SDPA over the view."""

    def __init__(self, state: IdealState, capacity: int):
        self.state, self.capacity, self.keys, self.values = state, capacity, None, None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        query, key = apply_rotary_emb(query, *self.state.rope), apply_rotary_emb(key, *self.state.rope)
        if self.keys is None:
            shape = (key.shape[0], self.capacity, *key.shape[2:])
            self.keys, self.values = key.new_empty(shape), value.new_empty(shape)
        start, end = self.state.length, self.state.length + key.shape[1]
        self.keys[:, start:end].copy_(key)
        self.values[:, start:end].copy_(value)
        out = dispatch_attention_fn(query, self.keys[:, :end], self.values[:, :end], attn_mask=None, dropout_p=0.0,
                                    is_causal=False)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


class IdealCrossProcessor:
    """Cross-attention over text K/V projected once."""

    def __init__(self):
        self.kv = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        if self.kv is None:
            key = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
            self.kv = key, attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(query, *self.kv, attn_mask=None, dropout_p=0.0, is_causal=False)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


class Ideal(Variant):
    name = "ideal"

    def __init__(self, model, text, preset: Preset):
        self.model, self.text, self.preset = model, text, preset
        self.state = IdealState()
        self.capacity = preset.frames * preset.frame_tokens

    def reset(self):
        self.state.length = 0
        for block in self.model.blocks:
            block.attn1.set_processor(IdealSelfProcessor(self.state, self.capacity))
            block.attn2.set_processor(IdealCrossProcessor())
        self._rope_start = None

    def _forward(self, x, t, start):
        if self._rope_start != start:
            positions = torch.arange(start, start + x.shape[2], device=x.device)
            self.state.rope = rope_for_frames(self.model.rope, positions, x.shape[3] // 2, x.shape[4] // 2)
            self._rope_start = start
        timestep = torch.full((x.shape[0],), float(t), device=x.device)
        return self.model(hidden_states=x, timestep=timestep, encoder_hidden_states=self.text, return_dict=False)[0]

    def denoise(self, x, t, start):
        return self._forward(x, t, start)

    def commit(self, x, start):
        self._forward(x, 0.0, start)
        self.state.length += x.shape[2] * self.preset.frame_tokens


# ---------------------------------------------------------------------------------------------------- rollout
def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def run_rollout(variant: Variant, noise, renoise, sigmas) -> tuple[torch.Tensor, list[float]]:
    """Few-step sampling per chunk (predict x0, re-noise to the next level), then one commit at t=0."""
    variant.reset()
    outputs, seconds, start = [], [], 0
    for chunk_idx, size in enumerate(chunk_sizes_of(noise, renoise)):
        synchronize(noise.device)
        began = time.perf_counter()
        x = noise[:, :, start:start + size]
        for i, sigma in enumerate(sigmas):
            x0 = x - sigma * variant.denoise(x, sigma * 1000, start)
            if i + 1 < len(sigmas):
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * renoise[chunk_idx][i]
        variant.commit(x0, start)
        synchronize(noise.device)
        seconds.append(time.perf_counter() - began)
        outputs.append(x0)
        start += size
    return torch.cat(outputs, dim=2), seconds


def chunk_sizes_of(noise, renoise) -> list[int]:
    return [r[0].shape[2] for r in renoise]


def make_inputs(preset: Preset, device, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (preset.batch, IN_CHANNELS, preset.frames, preset.height, preset.width)
    noise = torch.randn(shape, generator=g).to(device, dtype)
    renoise = [
        [torch.randn(preset.batch, IN_CHANNELS, size, preset.height, preset.width, generator=g).to(device, dtype)
         for _ in range(preset.steps)]
        for size in chunk_schedule(preset.frames, preset.chunk)
    ]
    text = torch.randn(preset.batch, preset.text_len, preset.text_dim, generator=g).to(device, dtype)
    return noise, renoise, text


# ---------------------------------------------------------------------------------------------------- analytics
def forward_flops(preset: Preset, query_tokens: int, key_tokens: int, project_text_kv: bool,
                  per_token_timesteps: bool) -> int:
    """Multiply-adds x 2 of one transformer forward: linear layers and attention (dense: a masked SDPA computes
    every score), plus the patch embedding, output projection, text and time embedders."""
    d, f, text = preset.dim, preset.ffn_dim, preset.text_len
    per_block = query_tokens * (4 * 2 * d * d + 2 * 2 * d * d + 2 * 2 * d * f)  # self qkvo, cross q/o, FFN
    per_block += 2 * 2 * query_tokens * key_tokens * d + 2 * 2 * query_tokens * text * d  # self and cross attention
    if project_text_kv:
        per_block += text * 2 * 2 * d * d
    patch = IN_CHANNELS * 4
    total = preset.layers * per_block + query_tokens * (2 * patch * d + 2 * d * patch)
    total += text * 2 * (preset.text_dim * d + d * d)
    time_tokens = query_tokens if per_token_timesteps else 1
    total += time_tokens * 2 * (preset.freq_dim * d + d * d + d * 6 * d)
    return preset.batch * total


def rollout_flops(preset: Preset) -> dict[str, int]:
    ft, cached, recompute, start = preset.frame_tokens, 0, 0, 0
    for k, size in enumerate(chunk_schedule(preset.frames, preset.chunk)):
        prefix, chunk = start * ft, size * ft
        per_step = forward_flops(preset, chunk, prefix + chunk, project_text_kv=k == 0, per_token_timesteps=False)
        cached += (preset.steps + 1) * per_step  # denoising steps + the commit pass
        recompute += preset.steps * forward_flops(preset, prefix + chunk, prefix + chunk, True, True)
        start += size
    return {"cached": cached, "no-cache": recompute}


def analytic_memory_bytes(preset: Preset, engine, element_size: int) -> int:
    """For every block and tag: 2 x batch x tokens x heads x head_dim x element size for the self entry (tokens: the
    cached ones, or for the static engine the allocated ones) plus the same over the text tokens for the cross one."""
    frames = engine.max_frames if isinstance(engine, StaticKVCacheEngine) else preset.frames
    tags = len(engine.tags())
    per_token = 2 * preset.batch * preset.heads * preset.head_dim * element_size
    return preset.layers * tags * per_token * (frames * preset.frame_tokens + preset.text_len)


def peak_process_memory_bytes() -> int:
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# ---------------------------------------------------------------------------------------------------- measurements
def measure_rollouts(preset: Preset, device, dtype, repeats: int):
    base = build_model(preset, device, dtype)
    stock, ideal_model = copy.deepcopy(base), copy.deepcopy(base)
    causal = base
    causal.set_attn_processor(CausalWanAttnProcessor())
    noise, renoise, text = make_inputs(preset, device, dtype)
    sigmas = list(SIGMAS[: preset.steps])
    variants = [
        Cached("cached-vanilla", causal, text, VanillaKVCacheEngine()),
        Cached("cached-static", causal, text, StaticKVCacheEngine(max_frames=preset.frames)),
        Ideal(ideal_model, text, preset),
        NoCache(stock, text, preset),
    ]
    seconds = {v.name: [] for v in variants}
    chunks = {v.name: [] for v in variants}
    outputs = {}
    for variant in variants:  # warm-up, also the outputs compared below
        outputs[variant.name] = run_rollout(variant, noise, renoise, sigmas)[0]
    for r in range(repeats):
        order = variants if r % 2 == 0 else variants[::-1]  # interleaved, alternating order
        for variant in order:
            _, per_chunk = run_rollout(variant, noise, renoise, sigmas)
            seconds[variant.name].append(sum(per_chunk))
            chunks[variant.name].append(per_chunk)
    element_size = torch.tensor([], dtype=dtype).element_size()
    engines = {v.name: v.engine for v in variants if isinstance(v, Cached)}
    reference = outputs["cached-static"].float()
    return {
        "seconds": {name: min(s) for name, s in seconds.items()},
        "chunk_seconds": {name: [min(c) for c in zip(*runs)] for name, runs in chunks.items()},
        "max_abs_diff_vs_static": {n: (o.float() - reference).abs().max().item() for n, o in outputs.items()},
        "memory_bytes": {n: e.memory_bytes() for n, e in engines.items()},
        "memory_bytes_analytic": {n: analytic_memory_bytes(preset, e, element_size) for n, e in engines.items()},
    }, causal, stock, (noise, text)


@torch.no_grad()
def measure_processor_overhead(causal, stock, noise, text, repeats: int) -> dict:
    """Processors installed, no context, vs stock processors: one bidirectional forward over every frame."""
    stock.set_attn_processor(WanAttnProcessor())
    timestep = torch.full((noise.shape[0],), 500.0, device=noise.device)
    times, outputs = time_interleaved(
        {name: lambda model=model: model(hidden_states=noise, timestep=timestep, encoder_hidden_states=text,
                                         return_dict=False)[0]
         for name, model in (("installed-no-context", causal), ("stock", stock))},
        rounds=repeats, warmup=1, device=noise.device)
    best = {name: min(t) for name, t in times.items()}
    return {
        "forward_seconds": best,
        "installed_no_context_vs_stock_ratio": best["installed-no-context"] / best["stock"],
        "installed_no_context_bitwise_equal": bool(torch.equal(outputs["installed-no-context"], outputs["stock"])),
    }


def time_interleaved(calls: dict, rounds: int, warmup: int, device) -> tuple[dict, dict]:
    """Seconds of each call per round (after ``warmup`` untimed rounds), the calls interleaved in alternating order,
    and each call's last result."""
    times, results = {name: [] for name in calls}, {}
    for r in range(warmup + rounds):
        for name, call in list(calls.items())[:: 1 if r % 2 else -1]:
            synchronize(device)
            began = time.perf_counter()
            results[name] = call()
            synchronize(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - began)
    return times, results


@torch.no_grad()
def measure_python_costs(device, rounds: int = 400, warmup: int = 50) -> dict:
    """Fixed per-forward costs, on the ``tiny`` model (one latent frame, 16 tokens) where they dominate: processors
    and hooks installed but no context vs stock (and a second stock copy, the noise floor of the comparison), and a
    cached forward in a ``CausalContext`` vs the bare ideal processors doing the same attention. Medians of
    interleaved rounds (alternating order), in microseconds."""
    preset = PRESETS["tiny"]
    dtype = torch.float32
    stock, stock_copy, installed = (build_model(preset, device, dtype) for _ in range(3))
    installed.set_attn_processor(CausalWanAttnProcessor())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, IN_CHANNELS, 1, preset.height, preset.width, generator=g).to(device)
    text = torch.randn(1, preset.text_len, preset.text_dim, generator=g).to(device)
    cached = Cached("cached", installed, text, VanillaKVCacheEngine())
    cached.commit(x, 0)  # one cached frame (this also installs the hooks), then every timed pass reads it
    ideal = Ideal(build_model(preset, device, dtype), text, replace(preset, frames=2))
    ideal.reset()
    ideal.commit(x, 0)
    timestep = torch.full((1,), 500.0, device=device)

    def stock_forward(model):
        return lambda: model(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)

    calls = {"stock": stock_forward(stock), "stock_copy": stock_forward(stock_copy),
             "installed_no_context": stock_forward(installed), "cached": lambda: cached.denoise(x, 500.0, 1),
             "ideal": lambda: ideal.denoise(x, 500.0, 1)}
    times, _ = time_interleaved(calls, rounds, warmup, device)
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {
        "layers": preset.layers, "forward_tokens": preset.frame_tokens, "rounds": rounds,
        "stock_us": us["stock"], "installed_no_context_us": us["installed_no_context"], "cached_us": us["cached"],
        "ideal_us": us["ideal"],
        "installed_no_context_vs_stock_ratio": us["installed_no_context"] / us["stock"],
        "stock_copy_vs_stock_ratio": us["stock_copy"] / us["stock"],
        "context_cost_us": us["cached"] - us["ideal"],
    }


def measure_compile(preset: Preset, device, dtype, backend: str) -> dict:
    """Cached rollouts (static engine) over blocks compiled with diffusers' compile_repeated_blocks: graph breaks,
    graphs compiled per rollout (every graph after the first is a recompile) and the difference to eager."""
    from torch._dynamo.utils import counters

    model = build_model(preset, device, dtype)
    model.set_attn_processor(CausalWanAttnProcessor())
    noise, renoise, text = make_inputs(preset, device, dtype)
    sigmas = list(SIGMAS[: preset.steps])
    variant = Cached("cached-static", model, text, StaticKVCacheEngine(max_frames=preset.frames))
    eager, eager_chunks = run_rollout(variant, noise, renoise, sigmas)
    torch._dynamo.reset()
    counters.clear()
    # Compiled graphs are specialised per block and kind of pass (not per chunk): allow that many.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * preset.layers)
    model.compile_repeated_blocks(backend=backend)
    began = time.perf_counter()
    compiled, _ = run_rollout(variant, noise, renoise, sigmas)
    first_seconds = time.perf_counter() - began
    first = {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}
    _, compiled_chunks = run_rollout(variant, noise, renoise, sigmas)
    return {
        "backend": backend,
        "graph_breaks_first_rollout": first["graph_breaks"],
        "graphs_compiled_first_rollout": first["graphs"],
        "recompiles_first_rollout": max(first["graphs"] - 1, 0),
        "graph_breaks_second_rollout": sum(counters["graph_break"].values()) - first["graph_breaks"],
        "recompiles_second_rollout": counters["stats"]["unique_graphs"] - first["graphs"],
        "first_rollout_seconds": first_seconds,
        "eager_seconds": sum(eager_chunks),
        "compiled_seconds": sum(compiled_chunks),
        "max_abs_diff_vs_eager": (compiled.float() - eager.float()).abs().max().item(),
    }


# ---------------------------------------------------------------------------------------------------- report
def print_table(report: dict) -> None:
    seconds, flops = report["seconds"], report["flops"]
    print(f"\ncausal rollout benchmark: preset {report['preset']} on {report['device']} ({report['dtype']}, "
          f"{report['threads']} threads), {report['date']}")
    print(f"{report['config']['frames']} latent frames in chunks {report['chunk_sizes']}, "
          f"{report['config']['steps']} steps, {report['repeats']} interleaved repeats (best of each)\n")
    header = f"{'variant':<16}{'rollout s':>11}{'vs ideal':>10}{'no-cache / this':>17}{'engine MiB':>12}"
    print(header)
    print("-" * len(header))
    for name, value in seconds.items():
        mem = report["memory_bytes"].get(name)
        print(f"{name:<16}{value:>11.3f}{value / seconds['ideal']:>9.3f}x"
              f"{seconds['no-cache'] / value:>16.2f}x{'' if mem is None else f'{mem / 2**20:.2f}':>12}")
    print(f"\nno-cache / cached: wall-clock {report['nocache_vs_cached_wall_ratio']['cached-static']:.2f}x (static), "
          f"{report['nocache_vs_cached_wall_ratio']['cached-vanilla']:.2f}x (vanilla); FLOP-predicted "
          f"{report['nocache_vs_cached_flop_ratio']:.2f}x ({flops['no-cache'] / 1e9:.2f} vs "
          f"{flops['cached'] / 1e9:.2f} GFLOP)")
    unjudged = "" if report["targets_judged"] else f"; not judged at --size {report['preset']}"
    print(f"static / ideal {report['engine_vs_ideal_ratio']['cached-static']:.3f}x (target <= "
          f"{TARGETS['static_vs_ideal']}{unjudged}), vanilla / ideal "
          f"{report['engine_vs_ideal_ratio']['cached-vanilla']:.3f}x")
    print(f"installed, no context / stock forward {report['installed_no_context_vs_stock_ratio']:.3f}x (target <= "
          f"{TARGETS['installed_no_context_vs_stock']}{unjudged})")
    print("memory_bytes() == analytic: " + ", ".join(
        f"{n} {report['memory_bytes'][n]} == {report['memory_bytes_analytic'][n]}: {report['memory_bytes_match'][n]}"
        for n in report["memory_bytes"]))
    print(f"peak process memory {report['peak_process_memory_bytes'] / 2**20:.0f} MiB")
    if not report["targets_judged"]:
        print(f"note: --size {report['preset']} is a smoke test: its forwards are so small that fixed Python costs "
              "and timer noise decide the ratios above, so a missed or met target means nothing here. Judge the "
              "targets with --size small or larger.")
    if "compile" in report:
        c = report["compile"]
        print(f"compile ({c['backend']}): {c['graph_breaks_first_rollout']} graph breaks, "
              f"{c['recompiles_first_rollout']} recompiles in the first rollout, "
              f"{c['recompiles_second_rollout']} in the second; "
              f"max |compiled - eager| {c['max_abs_diff_vs_eager']:.1e}")
    c = report["python_costs"]
    print(f"python costs on a tiny model ({c['forward_tokens']} tokens, {c['layers']} layers; medians of "
          f"{c['rounds']} interleaved rounds): stock forward {c['stock_us']:.0f} us; processors and hooks installed, "
          f"no context +{c['installed_no_context_us'] - c['stock_us']:.1f} us "
          f"({c['installed_no_context_vs_stock_ratio']:.3f}x; a second stock copy "
          f"{c['stock_copy_vs_stock_ratio']:.3f}x, the noise floor); cached forward in a context "
          f"+{c['context_cost_us']:.1f} us over the bare ideal processors ({c['ideal_us']:.0f} us)")
    if "realtime" in report:
        print_realtime(report["realtime"])


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(report: dict, path: str) -> None:
    import matplotlib  # checked at argument parsing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, per_chunk in report["chunk_seconds"].items():
        ax.plot(range(len(per_chunk)), per_chunk, marker="o", label=name)
    ax.set_xlabel("chunk")
    ax.set_ylabel("seconds (denoising + commit)")
    ax.set_title(f"per-chunk time, preset {report['preset']} on {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default: the preset's)")
    parser.add_argument("--plot", metavar="OUT.png", help="draw per-chunk time for each variant")
    parser.add_argument("--compile", action="store_true",
                        help="also run rollouts over compiled blocks and report graph breaks and recompiles")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--realtime", choices=sorted(SHAPES),
                        help="also measure a real-time stream (fps, time to first frame, per-chunk latency per mode) "
                             "at this shape; default wan-1.3b with --device cuda, none on CPU")
    parser.add_argument("--realtime-backend", default=None,
                        help="compile backend of the real-time rows (default: inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--realtime-repeats", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak rate for the FLOP bound (default: a measured dense matmul rate)")
    args = parser.parse_args(argv)
    if args.plot and not have_matplotlib():  # fail before the run, not after it
        parser.error("--plot needs matplotlib, which is not installed: python -m pip install matplotlib")
    preset = PRESETS[args.size]
    if args.repeats is not None:
        preset = replace(preset, repeats=args.repeats)
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False.")

    measured, causal, stock, (noise, text) = measure_rollouts(preset, args.device, dtype, preset.repeats)
    overhead = measure_processor_overhead(causal, stock, noise, text, max(4 * preset.repeats, 10))
    python_costs = measure_python_costs(args.device)
    flops = rollout_flops(preset)
    seconds = measured["seconds"]
    report = {
        "preset": args.size,
        "device": args.device,
        "dtype": args.dtype,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": asdict(preset),
        "chunk_sizes": chunk_schedule(preset.frames, preset.chunk),
        "repeats": preset.repeats,
        **measured,
        "flops": flops,
        "nocache_vs_cached_wall_ratio": {n: seconds["no-cache"] / seconds[n] for n in ("cached-vanilla",
                                                                                         "cached-static")},
        "nocache_vs_cached_flop_ratio": flops["no-cache"] / flops["cached"],
        "engine_vs_ideal_ratio": {n: seconds[n] / seconds["ideal"] for n in ("cached-vanilla", "cached-static")},
        **overhead,
        "python_costs": python_costs,
        "memory_bytes_match": {n: measured["memory_bytes"][n] == measured["memory_bytes_analytic"][n]
                               for n in measured["memory_bytes"]},
        "peak_process_memory_bytes": peak_process_memory_bytes(),
        "targets": TARGETS,
        "targets_judged": args.size not in SMOKE_PRESETS,
    }
    if args.device == "cuda":
        report["peak_cuda_memory_bytes"] = torch.cuda.max_memory_allocated()
    if args.compile:
        report["compile"] = measure_compile(preset, args.device, dtype, args.compile_backend)
    realtime = args.realtime or ("wan-1.3b" if args.device == "cuda" else None)
    if realtime:
        backend = args.realtime_backend or ("inductor" if args.device == "cuda" else "aot_eager")
        realtime_dtype = torch.bfloat16 if args.device == "cuda" else dtype
        report["realtime"] = measure_realtime(realtime, args.device, realtime_dtype, backend, args.realtime_repeats,
                                              args.peak_tflops)
    print_table(report)
    if args.plot:
        plot(report, args.plot)
        print(f"per-chunk plot written to {args.plot}")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
