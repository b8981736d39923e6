"""From a prompt to an mp4 with ``CausalWanPipeline``: causal, chunk-by-chunk generation with a KV cache.

By default it loads the tiny trained sprite model committed in ``models/tiny-sprites`` (a ``CausalWanPipeline``
folder written by ``examples/train_tiny_causal.py``: a ball or square moving and bouncing on a 32x32 frame, from a
prompt such as "red ball moving right"), so the script makes a video a person recognises, on a CPU, in seconds, most
of them importing torch and diffusers: prompt, text encoding, chunked rollout with the KV cache, decoding, mp4.

    python examples/causal_rollout.py --output causal_rollout.mp4 --strip docs/tiny_sprites_strip.png

``--random`` runs tiny random components built in code instead (transformer, VAE, a UMT5 text encoder and a
character-level tokenizer): the same path, a video of noise.

Real weights, where the Hugging Face hub or a local copy is reachable:

    # a causal checkpoint (a peer's file, converted on the fly, or a converted folder) + the base Wan components
    python examples/causal_rollout.py --checkpoint self_forcing_dmd.pt \\
        --model-id Wan-AI/Wan2.1-T2V-1.3B-Diffusers --height 480 --width 832 --num-frames 81
    # or a diffusers-format causal pipeline folder / repo on its own
    python examples/causal_rollout.py --model-id <causal-pipeline-folder>

The sampling settings (chunk size, timesteps, shift, context noise, guidance) come from the checkpoint's
``causal_config.json``; the flags below override them.

Every error in what it is given (an argument, a path, a checkpoint, a setting the pipeline refuses, an output it
cannot write) ends the script with one line, ``error: ...``, and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from diffusers.utils import export_to_video

from diffusers_causal_kv import CausalConfig, CausalWanPipeline
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan

SPRITES_MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-sprites"


class OneLineErrors(argparse.ArgumentParser):
    """argparse, whose usage errors end the script like every other error of it: one line, exit status 1."""

    def error(self, message):
        raise SystemExit(f"error: {message} (see --help)")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineErrors(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None,
                        help="diffusers-format Wan pipeline (hub id or folder): the base components, or the whole "
                             "causal pipeline without --checkpoint; default: the tiny sprite model in "
                             "models/tiny-sprites")
    parser.add_argument("--checkpoint", default=None,
                        help="causal transformer: a converted folder (python -m diffusers_causal_kv.convert) or a "
                             "peer's checkpoint file, converted next to it first; needs --model-id")
    parser.add_argument("--random", action="store_true",
                        help="tiny random components built in code instead of the sprite model (a video of noise)")
    parser.add_argument("--prompt", default=None,
                        help="default: 'red ball moving right' (sprite model), a fox in the snow otherwise")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--output", default="causal_rollout.mp4", help="mp4 file to write")
    parser.add_argument("--num-frames", type=positive_int, default=None,
                        help="video frames (4k+1); default: the checkpoint's (33, i.e. 9 latent frames, for --random)")
    parser.add_argument("--chunk-frames", type=positive_int, default=None, help="latent frames per chunk")
    parser.add_argument("--height", type=positive_int, default=None,
                        help="default: 32 for the sprite model, 64 otherwise")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="default: 32 for the sprite model, 64 otherwise")
    parser.add_argument("--timesteps", type=float, nargs="+", default=None,
                        help="few-step denoising timesteps per chunk (default: the checkpoint's)")
    parser.add_argument("--guidance-scale", type=float, default=None, help=">1 runs CFG through 'pos'/'neg' tags")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=positive_int, default=16)
    parser.add_argument("--strip", default=None, help="also write a PNG of the frames side by side (a frame strip)")
    parser.add_argument("--strip-frames", type=positive_int, default=12, help="frames in the strip (evenly spaced)")
    args = parser.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.output))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # before any work (ffmpeg would fail silently)
        parser.error(f"--output {args.output!r} cannot be written: its folder {folder!r} is not a writable folder")
    sprites = args.checkpoint is None and args.model_id is None and not args.random
    size = 32 if sprites else 64
    args.height, args.width = args.height or size, args.width or size
    if args.prompt is None:
        args.prompt = "red ball moving right" if sprites else "a red fox running through fresh snow, cinematic"
    return args


def tiny_pipeline(seed: int) -> CausalWanPipeline:
    """Tiny random components (diffusers' own initialisation) with the few-step settings of a Self-Forcing model."""
    transformer = tiny_wan(seed=seed, ffn_dim=64, init=None)
    config = CausalConfig(chunk_frames=3, timesteps=(1000, 750, 500, 250), shift=5.0, num_frames=33)
    return CausalWanPipeline(**tiny_pipeline_components(transformer, seed=seed), causal_config=config)


def from_pretrained(pipeline_class, model_id: str, dtype: torch.dtype, **kwargs):
    """``pipeline_class.from_pretrained(model_id)``; a checkpoint that cannot be reached or read ends the script with
    one line saying so (exit status 1) instead of a traceback."""
    try:
        return pipeline_class.from_pretrained(model_id, dtype=dtype, **kwargs)
    except (OSError, ValueError) as error:  # hub unreachable or offline, no such repo or folder, not a checkpoint
        reason = " ".join(str(error).replace("Please check out the root cause in the stacktrace above.", "").split())
        reason = reason if len(reason) <= 240 else reason[:240] + "..."
        raise SystemExit(
            f"error: could not load --model-id {model_id!r} ({type(error).__name__}: {reason}). A hub repo id needs "
            "network access to the Hugging Face hub (or a complete copy in the local hub cache); without it, pass "
            "the path of a local folder holding a diffusers-format checkpoint."
        ) from None


def causal_transformer(checkpoint: str, dtype: torch.dtype):
    """The causal transformer and its sampling settings from a converted folder, or from a peer's checkpoint file
    converted first into ``<file>.diffusers/`` (once)."""
    from diffusers import WanTransformer3DModel

    from diffusers_causal_kv.convert import convert_checkpoint

    if not os.path.exists(checkpoint):
        raise SystemExit(f"error: --checkpoint {checkpoint!r} does not exist; pass a converted folder (python -m "
                         "diffusers_causal_kv.convert) or a peer's checkpoint file.")
    folder = checkpoint
    if not os.path.isdir(checkpoint):
        folder = checkpoint + ".diffusers"
        if not os.path.isfile(os.path.join(folder, "config.json")):
            print(f"converting {checkpoint} -> {folder}")
            try:
                convert_checkpoint(checkpoint, folder, dtype=dtype)
            except (ValueError, OSError, RuntimeError) as error:  # refused, unreadable, or failed its check
                raise SystemExit(f"error: could not convert --checkpoint {checkpoint!r}: {one_line(error)}") from None
    try:
        transformer = WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype)
        return transformer, CausalConfig.find([folder])
    except (OSError, ValueError) as error:  # no diffusers model there, or a causal_config.json it refuses
        raise SystemExit(f"error: could not load --checkpoint {folder!r}: {one_line(error)}") from None


def sprites_pipeline(dtype: torch.dtype) -> CausalWanPipeline:
    """The tiny trained sprite model of ``models/tiny-sprites``."""
    if not (SPRITES_MODEL / "model_index.json").is_file():
        raise SystemExit(f"error: the sprite model is missing from {SPRITES_MODEL}; train it with `python "
                         "examples/train_tiny_causal.py --output models/tiny-sprites`, or pass --random.")
    return CausalWanPipeline.from_pretrained(SPRITES_MODEL, dtype=dtype)


def write_strip(frames, path: str, count: int, scale: int = 4, gap: int = 2) -> None:
    """``count`` evenly spaced frames side by side, each scaled up ``scale`` times (nearest), on a white strip."""
    import numpy as np
    from PIL import Image

    picks = np.linspace(0, len(frames) - 1, min(count, len(frames))).round().astype(int)
    height, width = frames.shape[1] * scale, frames.shape[2] * scale
    strip = np.full((height, len(picks) * (width + gap) - gap, 3), 255, dtype=np.uint8)
    for i, index in enumerate(picks):
        tile = (np.asarray(frames[index]) * 255).round().clip(0, 255).astype(np.uint8)
        strip[:, i * (width + gap):i * (width + gap) + width] = tile.repeat(scale, 0).repeat(scale, 1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(strip).save(path)


def load_pipeline(args, device: torch.device) -> CausalWanPipeline:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.checkpoint is None and args.model_id is None:
        return tiny_pipeline(args.seed) if args.random else sprites_pipeline(dtype)
    if args.checkpoint is None:
        return from_pretrained(CausalWanPipeline, args.model_id, dtype)
    if args.model_id is None:
        raise SystemExit("error: --checkpoint holds the causal transformer only; pass --model-id for the base Wan "
                         "components (text encoder, tokenizer, VAE), e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers.")
    transformer, config = causal_transformer(args.checkpoint, dtype)
    from diffusers import WanPipeline

    base = from_pretrained(WanPipeline, args.model_id, dtype, transformer=transformer)
    return CausalWanPipeline.from_pipe(base, causal_config=config)


def main(argv=None) -> str:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as error:  # a setting the pipeline refuses, an output path it cannot write
        raise SystemExit(f"error: {one_line(error)}") from None


def run(args: argparse.Namespace) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = load_pipeline(args, device).to(device)

    began = time.perf_counter()
    generator = torch.Generator(device).manual_seed(args.seed)
    frames = pipe(prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                  num_frames=args.num_frames, chunk_frames=args.chunk_frames, timesteps=args.timesteps,
                  guidance_scale=args.guidance_scale, generator=generator).frames[0]
    seconds = time.perf_counter() - began
    try:
        export_to_video(list(frames), args.output, fps=args.fps)
    except OSError as error:
        raise SystemExit(f"error: could not write --output {args.output!r}: {one_line(error)}") from None
    if args.strip is not None:
        write_strip(frames, args.strip, args.strip_frames)

    print(f"chunks (latent frames): {pipe.chunk_sizes}")
    for i, (size, chunk_seconds) in enumerate(zip(pipe.chunk_sizes, pipe.chunk_seconds)):
        print(f"  chunk {i}: {size} frames in {chunk_seconds * 1000:.1f} ms")
    print(f"pipeline call {seconds:.2f} s (text encoding, rollout, decoding); "
          f"cache: {pipe.transformer.kv_cache_engines['main']}")
    default = args.checkpoint is None and args.model_id is None
    note = ""
    if default and args.random:
        note = " (random weights: the video is noise; pass --checkpoint/--model-id for a real one)"
    elif default:
        note = f" (the tiny sprite model of models/tiny-sprites: {args.prompt!r})"
    print(f"wrote {len(frames)} frames of {frames.shape[2]}x{frames.shape[1]} to {args.output}{note}"
          + (f", frame strip {args.strip}" if args.strip else ""))
    return args.output


if __name__ == "__main__":
    main()
