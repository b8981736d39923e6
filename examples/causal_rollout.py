"""Causal, chunk-by-chunk video generation with a KV cache on a stock diffusers Wan transformer.

By default everything is tiny and random (transformer, VAE, prompt embeddings), so the script runs on a CPU in
about ten seconds, most of them importing torch and diffusers, and shows the whole loop: install the processors, roll
out chunk by chunk, decode, write an mp4. Random weights make a video of noise; ``--model-id`` gives a real one.

    python examples/causal_rollout.py --output causal_rollout.mp4

With ``--model-id`` (a diffusers-format Wan T2V checkpoint, e.g. a causal Self-Forcing/CausVid conversion) the same
loop runs on real weights with a real prompt, where the Hugging Face hub or a local copy is reachable.
"""

from __future__ import annotations

import argparse
import time

import torch
from diffusers.utils import export_to_video

from diffusers_causal_kv import CausalWanAttnProcessor, causal_rollout
from diffusers_causal_kv.testing import decode_latents, tiny_prompt_encoder, tiny_vae, tiny_wan


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None, help="diffusers-format Wan checkpoint; default: tiny random")
    parser.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    parser.add_argument("--output", default="causal_rollout.mp4", help="mp4 file to write")
    parser.add_argument("--num-frames", type=int, default=33, help="video frames (4k+1); 33 -> 9 latent frames")
    parser.add_argument("--chunk-frames", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--timesteps", type=float, nargs="+", default=[1000, 750, 500, 250],
                        help="few-step denoising timesteps per chunk (Self-Forcing)")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help=">1 runs CFG through 'pos'/'neg' tags")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=int, default=16)
    return parser.parse_args(argv)


def tiny_random_models(seed: int):
    """A tiny random Wan transformer (diffusers' own initialisation) and VAE, plus a stand-in prompt encoder."""
    transformer = tiny_wan(seed=seed, ffn_dim=64, init=None)
    return transformer, tiny_vae(), tiny_prompt_encoder  # the VAE continues the RNG seeded above


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


def pretrained_models(model_id: str, device: torch.device, dtype: torch.dtype):
    from diffusers import WanPipeline

    pipe = from_pretrained(WanPipeline, model_id, dtype).to(device)

    def encode(prompt: str, batch: int = 1) -> torch.Tensor:
        embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, num_videos_per_prompt=batch,
                                       device=device, dtype=dtype)
        return embeds

    return pipe.transformer, pipe.vae, encode


def main(argv=None) -> str:
    args = parse_args(argv)
    if (args.num_frames - 1) % 4:
        raise SystemExit(f"--num-frames must be 4k+1 (the Wan VAE's temporal compression), got {args.num_frames}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and args.model_id else torch.float32
    if args.model_id:
        transformer, vae, encode = pretrained_models(args.model_id, device, dtype)
    else:
        transformer, vae, encode = tiny_random_models(args.seed)
        transformer, vae = transformer.to(device), vae.to(device)
    transformer.eval()

    # The one line that makes the stock transformer causal.
    transformer.set_attn_processor(CausalWanAttnProcessor())

    latent_frames = (args.num_frames - 1) // 4 + 1
    channels = transformer.config.out_channels
    g = torch.Generator(device).manual_seed(args.seed)
    noise = torch.randn(1, channels, latent_frames, args.height // 8, args.width // 8, generator=g, device=device,
                        dtype=dtype)
    prompt_embeds = encode(args.prompt).to(device, dtype)
    negative = encode("").to(device, dtype) if args.guidance_scale != 1.0 else None

    began = time.perf_counter()
    result = causal_rollout(transformer, noise, prompt_embeds, negative_prompt_embeds=negative,
                            guidance_scale=args.guidance_scale, chunk_frames=args.chunk_frames,
                            timesteps=args.timesteps, generator=g)
    rollout_seconds = time.perf_counter() - began
    frames = decode_latents(vae, result.latents)
    export_to_video(list(frames), args.output, fps=args.fps)

    print(f"chunks (latent frames): {result.chunk_sizes}")
    for i, (size, seconds) in enumerate(zip(result.chunk_sizes, result.chunk_seconds)):
        print(f"  chunk {i}: {size} frames in {seconds * 1000:.1f} ms")
    print(f"rollout {rollout_seconds:.2f} s; cache: {transformer.kv_cache_engines['main']}")
    print(f"wrote {len(frames)} frames of {frames.shape[2]}x{frames.shape[1]} to {args.output}"
          + ("" if args.model_id else " (random weights: the video is noise; pass --model-id for a real checkpoint)"))
    return args.output


if __name__ == "__main__":
    main()
