"""Long-rollout quality of the tiny sprite model, measured with a tracker, side by side in one run.

    python benchmarks/quality.py                       # short run: a table and a JSON line (under 2 minutes)
    python benchmarks/quality.py --plot quality.png --plot-chunks 500   # plus per-chunk metrics over 500 chunks

The model is the tiny trained sprite model (``models/tiny-sprites``, written by ``examples/train_tiny_causal.py``):
one ball or square moving at constant speed and bouncing off the walls of a 32x32 frame, from prompts such as
"red ball moving right". Every setting generates the same prompts from the same noise (one sample per prompt, in one
batch), the frames are decoded by the model's VAE, and ``examples/sprites/track.py`` turns them into trajectories.
Per chunk, and averaged over the chunks and prompts of a setting:

* ``present``: fraction of frames in which the sprite (the colour the prompt names) is found;
* ``physics``: mean distance (pixels) between the sprite and its constant-velocity-with-bounces prediction from the
  two frames before; the task's own videos score 0.00, the VAE's reconstructions of them ``vae_floor`` (printed);
* ``speed``: mean pixels moved per frame (the task's sprites move 1.5 to 1.7);
* ``drift``: ``|mean - mean_ref| + |std - std_ref|`` of the chunk's pixels against the task's rendered frames;
* ``late``: the same metrics over the last quarter of the chunks (where a cache that degrades shows it).

Settings: ``bidirectional`` (stock attention, every frame at once, the same few-step sampling), ``full cache`` (the
vanilla engine), rolling windows ``W`` with and without a sink ``S`` (relative positions), a rollout past the RoPE
table (``rope_max_seq_len``) with absolute positions (an error, as documented) and with relative positions, and a
prompt switch halfway (the sprite is asked to change colour) with a re-cache of the window and without one
(``"cross"``: new cross-attention entries only), scored on the new colour after the switch, and the full cache
stored in fp8 (``kv_dtype=torch.float8_e4m3fn``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from diffusers_causal_kv import (
    CausalWanAttnProcessor,
    CausalWanPipeline,
    RollingKVCacheEngine,
    StreamingRollout,
    VanillaKVCacheEngine,
    causal_rollout,
)
from diffusers_causal_kv.session import shifted_sigmas
from diffusers_causal_kv.testing import decode_latents

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from sprites import judge, task, track  # noqa: E402

PROMPTS = ["red ball moving right", "green square moving left", "blue ball moving down", "yellow square moving up"]
# Every colour, both shapes and every direction, each twice: the prompt-following table.
FOLLOW_PROMPTS = PROMPTS + ["red square moving up", "green ball moving down", "blue square moving right",
                            "yellow ball moving left"]
SWITCH_TO = {"red": "blue", "green": "yellow", "blue": "red", "yellow": "green"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny-sprites"))
    parser.add_argument("--chunks", type=int, default=8, help="chunks per rollout in the table")
    parser.add_argument("--windows", type=int, nargs="+", default=[6, 9, 12], help="rolling window sizes (frames)")
    parser.add_argument("--sink", type=int, default=3, help="sink frames of the 'with a sink' rows")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="PNG of per-chunk metrics over --plot-chunks chunks")
    parser.add_argument("--plot-chunks", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--follow-seeds", type=int, nargs="*", default=[0],
                        help="seeds of the prompt-following table (none: skip it)")
    return parser.parse_args(argv)


class Bench:
    """The model, its sampling settings and the prompts' embeddings."""

    def __init__(self, model: str, prompts: list[str], seed: int):
        self.pipe = CausalWanPipeline.from_pretrained(model)
        self.transformer = self.pipe.transformer
        self.transformer.set_attn_processor(CausalWanAttnProcessor())
        self.config = self.pipe.causal_config
        sizes = self.config.chunk_frames
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        if len(set(sizes[1:])) > 1:  # the metrics below read a first chunk and one size after it
            raise ValueError(f"{model}: this benchmark scores chunks of one size after the first, not {sizes}")
        self.first, self.chunk = sizes[0], sizes[-1]
        self.prompts, self.seed = prompts, seed
        self.guidance = self.config.guidance_scale
        with torch.no_grad():
            self.embeds = self.encode(prompts)
            self.negative = self.pipe.encode_prompt([""] * len(prompts), do_classifier_free_guidance=False)[0]
        self.sprites = [task.Sprite.parse(p) for p in prompts]

    def encode(self, prompts: list[str]) -> torch.Tensor:
        return self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False)[0]

    def frames(self, chunks: int) -> int:
        """Latent frames of a rollout of ``chunks`` chunks."""
        return self.first + (chunks - 1) * self.chunk

    def start(self, chunk: int) -> int:
        """The first latent frame of chunk ``chunk``."""
        return 0 if chunk == 0 else self.frames(chunk)

    def plan(self, frames: int) -> list[int]:
        """The model's chunk sizes for a rollout of ``frames`` latent frames (from :meth:`frames`)."""
        return [self.first] + [self.chunk] * ((frames - self.first) // self.chunk)

    def noise(self, frames: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(len(self.prompts), self.transformer.config.in_channels, frames, 8, 8, generator=g)

    def sampling(self) -> dict:
        return dict(timesteps=self.config.timesteps, shift=self.config.shift,
                    context_noise=self.config.context_noise, context_noise_mode=self.config.context_noise_mode,
                    guidance_scale=self.guidance, negative_prompt_embeds=self.negative if self.guidance > 1 else None)

    def rollout(self, frames: int, engine=None, sampler: str = "chunkwise") -> torch.Tensor:
        engines = {"main": engine if engine is not None else VanillaKVCacheEngine()}
        return causal_rollout(self.transformer, self.noise(frames), self.embeds, cache_engines=engines,
                              generator=torch.Generator().manual_seed(self.seed + 1), progress=False,
                              sampler=sampler, chunk_frames=self.plan(frames), **self.sampling()).latents

    @torch.no_grad()
    def bidirectional(self, frames: int) -> torch.Tensor:
        """Every frame at once, stock attention (no context: the processors compute the stock attention), the same
        few-step sampling (predict x0, re-noise to the next level) and guidance."""
        x, g = self.noise(frames), torch.Generator().manual_seed(self.seed + 1)
        sigmas = shifted_sigmas(self.config.timesteps, self.config.shift).tolist()
        for i, sigma in enumerate(sigmas):
            t = torch.full((x.shape[0],), sigma * 1000)
            flow = self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=self.embeds,
                                    return_dict=False)[0]
            if self.guidance > 1:
                unconditional = self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=self.negative,
                                                 return_dict=False)[0]
                flow = unconditional + self.guidance * (flow - unconditional)
            x0 = x - sigma * flow
            x = x0 if i + 1 == len(sigmas) else (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(
                x0.shape, generator=g)
        return x

    def switched(self, frames: int, switch_chunk: int, mode: str, window: int) -> torch.Tensor:
        """A stream that switches every prompt to another colour before chunk ``switch_chunk``."""
        new = self.encode([self.switched_prompt(p) for p in self.prompts])
        stream = StreamingRollout(self.transformer, self.embeds, cache_engines={"main": RollingKVCacheEngine(
            window, 0, positions="relative")}, generator=torch.Generator().manual_seed(self.seed + 1),
            chunk_frames=self.chunk, **self.sampling())
        noise = self.noise(frames)
        split = self.start(switch_chunk)
        first = stream.generate(noise[:, :, :split], chunk_frames=self.plan(split)).latents
        stream.switch_prompt(new, mode=mode)
        return torch.cat([first, stream.generate(noise[:, :, split:]).latents], dim=2)

    @staticmethod
    def switched_prompt(prompt: str) -> str:
        sprite = task.Sprite.parse(prompt)
        return task.Sprite(SWITCH_TO[sprite.colour], sprite.shape, sprite.direction).prompt

    def decode(self, latents: torch.Tensor) -> list[np.ndarray]:
        return [decode_latents(self.pipe.vae, latents[i:i + 1]) for i in range(latents.shape[0])]

    def metrics(self, latents: torch.Tensor, switch_frame: int | None = None) -> list[list[track.ChunkMetrics]]:
        """Per prompt, per chunk metrics; after ``switch_frame`` the sprite is tracked in its new colour."""
        out = []
        for video, sprite in zip(self.decode(latents), self.sprites):
            colours = [sprite.colour] * len(video)
            if switch_frame is not None:
                colours[switch_frame:] = [SWITCH_TO[sprite.colour]] * (len(video) - switch_frame)
            out.append(track.chunk_metrics(video, colours, sprite.shape, self.chunk, first_chunk=self.first))
        return out


def summarise(per_prompt: list[list[track.ChunkMetrics]], first_chunk: int = 0) -> dict:
    """Means over prompts and chunks (from ``first_chunk``), and over the last quarter of the chunks."""
    def mean(rows, name):
        values = [getattr(m, name) for m in rows]
        values = [v for v in values if np.isfinite(v)]
        return round(float(np.mean(values)), 3) if values else float("nan")

    chunks = len(per_prompt[0])
    late_from = max(first_chunk, chunks - max(1, chunks // 4))
    rows = [m for prompt in per_prompt for m in prompt[first_chunk:]]
    late = [m for prompt in per_prompt for m in prompt[late_from:]]
    names = ("present", "physics_px", "speed_px", "pixel_drift")
    return {**{n: mean(rows, n) for n in names}, **{f"late_{n}": mean(late, n) for n in names}}


def vae_floor(bench: Bench, frames: int) -> float:
    """Physics error of the VAE's reconstructions of the task's own clips (what a perfect transformer would get)."""
    rng = np.random.default_rng(bench.seed)
    errors = []
    for prompt in bench.prompts:
        clip = task.sample_clip(frames, rng, prompt)
        with torch.no_grad():
            z = bench.pipe.vae.encode(task.to_model_range(clip.frames)).latent_dist.mean
            video = task.from_model_range(bench.pipe.vae.decode(z, return_dict=False)[0])
        sprite = task.Sprite.parse(prompt)
        errors.append(np.nanmean(track.physics_errors(track.track(video, sprite.colour, sprite.shape)[0])))
    return round(float(np.mean(errors)), 3)


def run_table(bench: Bench, chunks: int, windows: list[int], sink: int) -> dict:
    frames = bench.frames(chunks)
    rope = bench.transformer.config.rope_max_seq_len
    past = bench.frames(rope // bench.chunk + 2)  # a rollout that ends past the RoPE table
    rows = {}

    def row(name, make, switch_frame=None, first_chunk=0):
        began = time.perf_counter()
        try:
            latents = make()
        except (ValueError, RuntimeError) as error:
            rows[name] = {"error": str(error).split(";")[0][:90]}
            return
        rows[name] = {**summarise(bench.metrics(latents, switch_frame), first_chunk),
                      "seconds": round(time.perf_counter() - began, 1)}

    row("bidirectional (all frames at once)", lambda: bench.bidirectional(frames))
    row("causal, full cache", lambda: bench.rollout(frames))
    row("causal, full cache, fp8 K/V",
        lambda: bench.rollout(frames, VanillaKVCacheEngine(kv_dtype=torch.float8_e4m3fn)))
    for window in windows:
        row(f"rolling W={window}", lambda w=window: bench.rollout(frames, RollingKVCacheEngine(w, 0, "relative")))
        if window - sink >= bench.chunk:
            row(f"rolling W={window} sink {sink}",
                lambda w=window: bench.rollout(frames, RollingKVCacheEngine(w, sink, "relative")))
    window = windows[len(windows) // 2]
    row(f"past RoPE ({past} fr) absolute W={window}",
        lambda: bench.rollout(past, RollingKVCacheEngine(window, 0, "absolute")))
    row(f"past RoPE ({past} fr) relative W={window}",
        lambda: bench.rollout(past, RollingKVCacheEngine(window, 0, "relative")))
    # the same weights sampled by Rolling Forcing's staggered window (one chunk per timestep): never trained for it
    row("rolling forcing, full cache (untuned)", lambda: bench.rollout(frames, sampler="rolling_forcing"))
    switch_chunk = chunks // 2
    for mode, label in (("recache", "re-cache"), ("cross", "no re-cache")):
        row(f"prompt switch, {label} W={window}", lambda m=mode: bench.switched(frames, switch_chunk, m, window),
            switch_frame=bench.start(switch_chunk), first_chunk=switch_chunk)
    return rows


def prompt_following(pipe: CausalWanPipeline, seed: int, switch_chunk: int = 3) -> dict:
    """Does the model do what its prompts say? The pipeline call with the model's own settings (as the main job
    runs it) for :data:`FOLLOW_PROMPTS`, judged frame by frame (``examples/sprites/judge.py``), and a stream whose
    prompt switches from yellow to green before chunk ``switch_chunk``: how many chunks until green shows, and the
    share of green frames from the switch on."""
    size = task.SIZE
    verdicts = []
    for prompt in FOLLOW_PROMPTS:
        frames = pipe(prompt=prompt, height=size, width=size, output_type="np",
                      generator=torch.Generator().manual_seed(seed)).frames[0]
        verdicts.append(judge.judge(frames, prompt))
    result = judge.summary(verdicts)
    old, new = "yellow ball moving right", "green ball moving right"
    stream = pipe.stream(prompt=old, height=size, width=size, output_type="np", prompt_schedule={switch_chunk: new},
                         num_frames=pipe.causal_config.num_frames, generator=torch.Generator().manual_seed(seed))
    chunks = list(stream)
    frames = np.concatenate([made.frames[0] for made in chunks])
    split, chunk = chunks[switch_chunk].video_frames.start, len(chunks[switch_chunk].video_frames)
    verdict = judge.judge(frames, [old] * split + [new] * (len(frames) - split))
    result["switch_chunks"] = judge.chunks_to_new_colour(verdict, "green", split, chunk)
    result["switch_new_colour"] = float(verdict.colour_right[split:].mean())
    return result


def print_following(results: dict[int, dict]) -> None:
    header = (f"{'seed':>4} {'sprite':>7} {'colour':>7} {'shape':>6} {'direction':>9} {'speed':>6} {'/task':>6} "
              f"{'switch: chunks':>14} {'new colour':>10}")
    print(header)
    print("-" * len(header))
    for seed, r in results.items():
        print(f"{seed:>4} {r['present']:7.2f} {r['colour']:7.2f} {r['shape']:6.2f} "
              f"{r['direction']:>5}/{r['videos']:<3} "
              f"{r['speed']:6.2f} {r['speed_ratio']:6.2f} {str(r['switch_chunks']):>14} {r['switch_new_colour']:10.2f}")
    print(f"(fractions of frames: a sprite; the prompt's colour (of all frames); the prompt's shape (of frames with a "
          f"sprite); videos starting off the prompt's way; median px/frame, the task's is {judge.TASK_SPEED:.2f}; "
          "a yellow -> green switch: chunks until green shows, green frames from the switch on)")


def print_table(rows: dict, floor: float) -> None:
    header = f"{'setting':<40} {'present':>7} {'physics':>7} {'speed':>6} {'drift':>6} | {'late: present':>13} " \
             f"{'physics':>7} {'drift':>6} {'s':>5}"
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<40} error: {r['error']}")
            continue
        print(f"{name:<40} {r['present']:7.2f} {r['physics_px']:7.2f} {r['speed_px']:6.2f} {r['pixel_drift']:6.3f} | "
              f"{r['late_present']:13.2f} {r['late_physics_px']:7.2f} {r['late_pixel_drift']:6.3f} "
              f"{r['seconds']:5.1f}")
    print(f"(physics in pixels; the VAE's reconstructions of the task's own clips score {floor:.2f}; prompt-switch "
          "rows are scored from the switch on, in the new colour)")


def plot_long(bench: Bench, chunks: int, windows: list[int], sink: int, path: str) -> dict:
    """Per-chunk metrics (mean over prompts) of long rollouts with rolling windows, relative positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = bench.frames(chunks)
    series = {}
    for window in windows:
        for s in (0, sink):
            if window - s < bench.chunk:
                continue
            began = time.perf_counter()
            latents = bench.rollout(frames, RollingKVCacheEngine(window, s, "relative"))
            per_prompt = bench.metrics(latents)
            series[f"W={window}" + (f" sink {s}" if s else "")] = {
                name: np.array([[getattr(m, name) for m in prompt] for prompt in per_prompt])
                for name in ("present", "physics_px", "pixel_drift")}
            print(f"plot: W={window} S={s}: {chunks} chunks in {time.perf_counter() - began:.1f} s", flush=True)
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    window_chunks = max(1, chunks // 50)
    for i, (label, values) in enumerate(series.items()):
        for ax, name in zip(axes, ("present", "physics_px", "pixel_drift")):
            with warnings.catch_warnings(action="ignore", category=RuntimeWarning):  # chunks with no tracked frame
                mean = np.nanmean(values[name], axis=0)
            smooth = np.convolve(np.nan_to_num(mean), np.ones(window_chunks) / window_chunks, mode="valid")
            ax.plot(np.arange(len(smooth)) + window_chunks - 1, smooth, label=label, color=f"C{i}")
            ax.set_ylabel(name)
    axes[0].legend(ncol=3, fontsize=8)
    axes[-1].set_xlabel(f"chunk ({bench.chunk} latent frames each after the first; moving average over "
                        f"{window_chunks})")
    fig.suptitle(f"tiny sprite model: {chunks}-chunk rollouts, mean over {len(bench.prompts)} prompts")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {label: {name: round(float(np.nanmean(v)), 3) for name, v in values.items()}
            for label, values in series.items()}


def _finite(value):
    """NaN (a metric with no defined value, e.g. no tracked frame) as JSON null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot is not None:
        try:  # fail before the run, not after it
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(
                "--plot needs matplotlib, which is not installed: python -m pip install matplotlib") from None
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    bench = Bench(args.model, PROMPTS[:args.prompts], args.seed)
    rows = run_table(bench, args.chunks, args.windows, args.sink)
    floor = vae_floor(bench, bench.frames(args.chunks))
    print(f"tiny sprite model ({args.model}), {args.chunks} chunks of {bench.chunk} frames (the first "
          f"{bench.first}), "
          f"{len(bench.prompts)} prompts, seed {args.seed}")
    print_table(rows, floor)
    result = {"chunks": args.chunks, "prompts": len(bench.prompts), "seed": args.seed, "vae_floor_physics_px": floor,
              "rows": rows}
    if args.follow_seeds:  # the pipeline as loaded, with its own engines (the table's rollouts bring theirs)
        pipe = CausalWanPipeline.from_pretrained(args.model)
        pipe.set_progress_bar_config(disable=True)
        result["following"] = {seed: prompt_following(pipe, seed) for seed in args.follow_seeds}
        print(f"prompt following: {len(FOLLOW_PROMPTS)} prompts, the pipeline call with the model's settings")
        print_following(result["following"])
    if args.plot is not None:
        result["long"] = plot_long(bench, args.plot_chunks, args.windows, args.sink, args.plot)
        print(f"wrote {args.plot}")
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(_finite(result)))
    return result


if __name__ == "__main__":
    main()
