"""Causal VACE control: generate a video chunk by chunk, steered by a depth video, on a stock diffusers
``WanVACETransformer3DModel`` with a KV cache per branch ("main" for the transformer blocks, "vace" for the
control blocks).

By default everything is tiny and random; the control video is synthetic (a square moving across the frame,
rendered as a depth map: near is bright), so the script runs on a CPU in about ten seconds (most of them imports);
random weights make a video of noise:

    python examples/causal_vace_rollout.py --output causal_vace_rollout.mp4

The control latents are built with diffusers' own ``WanVACEPipeline`` helpers (``preprocess_conditions``,
``prepare_video_latents``, ``prepare_masks``), exactly as the stock pipeline builds them, then sliced per chunk by
``causal_rollout``. With ``--model-id`` (a diffusers-format Wan VACE checkpoint) the same loop runs on real weights.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import PIL.Image
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline
from diffusers.utils import export_to_video

from diffusers_causal_kv import CausalWanAttnProcessor, causal_rollout
from diffusers_causal_kv.testing import decode_latents, tiny_prompt_encoder, tiny_vace, tiny_vae


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None, help="diffusers-format Wan VACE checkpoint; default: tiny random")
    parser.add_argument("--prompt", default="a glowing cube sliding over a dark floor")
    parser.add_argument("--output", default="causal_vace_rollout.mp4", help="mp4 file to write")
    parser.add_argument("--control-output", default=None, help="also write the synthetic depth video here")
    parser.add_argument("--num-frames", type=int, default=33, help="video frames (4k+1); 33 -> 9 latent frames")
    parser.add_argument("--chunk-frames", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--timesteps", type=float, nargs="+", default=[1000, 750, 500, 250],
                        help="few-step denoising timesteps per chunk (Self-Forcing)")
    parser.add_argument("--control-scale", type=float, default=1.0, help="strength of every VACE layer")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help=">1 runs CFG through 'pos'/'neg' tags")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=int, default=16)
    return parser.parse_args(argv)


def moving_square_depth(num_frames: int, height: int, width: int) -> list[PIL.Image.Image]:
    """A depth video: a far background ramp (dark at the top, lighter at the bottom) and a near square (bright)
    moving from left to right."""
    rows = np.linspace(0.1, 0.4, height, dtype=np.float32)[:, None].repeat(width, axis=1)
    side = max(height // 4, 2)
    top = (height - side) // 2
    frames = []
    for i in range(num_frames):
        depth = rows.copy()
        left = round(i / max(num_frames - 1, 1) * (width - side))
        depth[top:top + side, left:left + side] = 1.0
        frames.append(PIL.Image.fromarray((np.stack([depth] * 3, axis=-1) * 255).astype(np.uint8)))
    return frames


def tiny_random_pipeline(seed: int) -> WanVACEPipeline:
    """A tiny random VACE transformer (VACE layers 0 and 2 of 3) and VAE in a text-encoder-free pipeline."""
    # vace_in_channels: inactive + reactive video latents (2 x 16) and the 8x8 spatial mask (64).
    transformer = tiny_vace(seed=seed, ffn_dim=64, vace_in_channels=96, init=None)
    return WanVACEPipeline(tokenizer=None, text_encoder=None, vae=tiny_vae(),
                           scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer)


def from_pretrained(pipeline_class, model_id: str, dtype: torch.dtype):
    """``pipeline_class.from_pretrained(model_id)``; a checkpoint that cannot be reached or read ends the script with
    one line saying so (exit status 1) instead of a traceback."""
    try:
        return pipeline_class.from_pretrained(model_id, dtype=dtype)
    except (OSError, ValueError) as error:  # hub unreachable or offline, no such repo or folder, not a checkpoint
        reason = " ".join(str(error).replace("Please check out the root cause in the stacktrace above.", "").split())
        reason = reason if len(reason) <= 240 else reason[:240] + "..."
        raise SystemExit(
            f"error: could not load --model-id {model_id!r} ({type(error).__name__}: {reason}). A hub repo id needs "
            "network access to the Hugging Face hub (or a complete copy in the local hub cache); without it, pass "
            "the path of a local folder holding a diffusers-format checkpoint."
        ) from None


def control_latents(pipe: WanVACEPipeline, frames, height: int, width: int, device, dtype) -> torch.Tensor:
    """The stock pipeline's VACE conditioning for a control video with an all-ones mask (the whole video steers):
    ``[1, vace_in_channels, latent_frames, height / 8, width / 8]``."""
    video, mask, references = pipe.preprocess_conditions(frames, None, None, 1, height, width, len(frames),
                                                         torch.float32, device)
    with torch.no_grad():
        latents = pipe.prepare_video_latents(video, mask, references, None, device)
    return torch.cat([latents, pipe.prepare_masks(mask, references)], dim=1).to(dtype)


def main(argv=None) -> str:
    args = parse_args(argv)
    if (args.num_frames - 1) % 4:
        raise SystemExit(f"--num-frames must be 4k+1 (the Wan VAE's temporal compression), got {args.num_frames}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and args.model_id else torch.float32
    if args.model_id:
        pipe = from_pretrained(WanVACEPipeline, args.model_id, dtype).to(device)

        def encode(prompt: str) -> torch.Tensor:
            return pipe.encode_prompt(prompt, do_classifier_free_guidance=False, device=device, dtype=dtype)[0]
    else:
        pipe, encode = tiny_random_pipeline(args.seed).to(device), tiny_prompt_encoder
    transformer = pipe.transformer.eval()

    # The one line that makes the stock transformer causal; it installs both the "main" and the "vace" branch.
    transformer.set_attn_processor(CausalWanAttnProcessor())

    depth = moving_square_depth(args.num_frames, args.height, args.width)
    if args.control_output:
        export_to_video([np.asarray(frame) / 255 for frame in depth], args.control_output, fps=args.fps)
    control = control_latents(pipe, depth, args.height, args.width, device, dtype)
    scale = torch.full((len(transformer.config.vace_layers),), args.control_scale, device=device)

    g = torch.Generator(device).manual_seed(args.seed)
    noise = torch.randn(1, transformer.config.out_channels, *control.shape[2:], generator=g, device=device,
                        dtype=dtype)
    prompt_embeds = encode(args.prompt).to(device, dtype)
    negative = encode("").to(device, dtype) if args.guidance_scale != 1.0 else None

    began = time.perf_counter()
    result = causal_rollout(transformer, noise, prompt_embeds, negative_prompt_embeds=negative,
                            guidance_scale=args.guidance_scale, chunk_frames=args.chunk_frames,
                            timesteps=args.timesteps, control_latents=control, control_scale=scale, generator=g)
    rollout_seconds = time.perf_counter() - began
    frames = decode_latents(pipe.vae, result.latents)
    export_to_video(list(frames), args.output, fps=args.fps)

    print(f"chunks (latent frames): {result.chunk_sizes}")
    for i, (size, seconds) in enumerate(zip(result.chunk_sizes, result.chunk_seconds)):
        print(f"  chunk {i}: {size} frames in {seconds * 1000:.1f} ms")
    print(f"rollout {rollout_seconds:.2f} s")
    for branch, engine in transformer.kv_cache_engines.items():
        print(f"  {branch!r} cache: {engine.memory_bytes()} bytes, {engine}")
    print(f"wrote {len(frames)} frames of {frames.shape[2]}x{frames.shape[1]} to {args.output}"
          + ("" if args.model_id else " (random weights: the video is noise; pass --model-id for a real checkpoint)"))
    return args.output


if __name__ == "__main__":
    main()
