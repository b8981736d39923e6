"""A long causal rollout with bounded memory: hundreds of chunks on a rolling KV cache, with a prompt switch midway.

The transformer's ``"main"`` branch gets a ``RollingKVCacheEngine`` (a window of recent latent frames plus attention
sink frames, positions re-indexed inside the window), so the cache stays the same size however long the video gets
and the rollout runs far past the model's RoPE table (``rope_max_seq_len``). Halfway through, the prompt changes:
the window is re-cached under the new prompt (LongLive-style) and generation continues. A memory line is printed
every few chunks; the video is decoded and written as an mp4.

    python examples/long_rollout.py --output long_rollout.mp4

By default everything is tiny and random (the models of ``examples/causal_rollout.py``), so it runs on a CPU; with
``--model-id`` (a diffusers-format causal Wan T2V checkpoint) the same loop runs on real weights.
"""

from __future__ import annotations

import argparse
import time

import torch
from diffusers.utils import export_to_video

from diffusers_causal_kv import CausalWanAttnProcessor, RollingKVCacheEngine, StreamingRollout
from diffusers_causal_kv.testing import decode_latents, tiny_prompt_encoder, tiny_vae, tiny_wan


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None, help="diffusers-format Wan checkpoint; default: tiny random")
    parser.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    parser.add_argument("--switch-prompt", default="the fox reaches a frozen lake at dusk, cinematic")
    parser.add_argument("--switch-at", type=int, default=None, help="chunk index of the prompt switch; default: half")
    parser.add_argument("--output", default="long_rollout.mp4", help="mp4 file to write")
    parser.add_argument("--num-chunks", type=int, default=200)
    parser.add_argument("--chunk-frames", type=int, default=1, help="latent frames per chunk")
    parser.add_argument("--window-frames", type=int, default=6, help="latent frames a chunk attends to at most")
    parser.add_argument("--sink-frames", type=int, default=1, help="first frames every chunk keeps attending to")
    parser.add_argument("--positions", choices=["relative", "absolute"], default="relative",
                        help="relative: RoPE re-indexed inside the window (unbounded length)")
    parser.add_argument("--memory-every", type=int, default=20, help="print the memory line every N chunks")
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--timesteps", type=float, nargs="+", default=[1000, 750, 500, 250],
                        help="few-step denoising timesteps per chunk (Self-Forcing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=int, default=16)
    return parser.parse_args(argv)


def load_models(model_id: str | None, seed: int, device: torch.device, dtype: torch.dtype):
    """(transformer, VAE, prompt encoder): those of a diffusers-format Wan T2V checkpoint, or with no ``model_id``
    the tiny random models of ``examples/causal_rollout.py``."""
    if model_id is None:
        transformer = tiny_wan(seed=seed, ffn_dim=64, init=None)  # diffusers' own initialisation
        return transformer.to(device), tiny_vae().to(device), tiny_prompt_encoder
    from diffusers import WanPipeline

    pipe = from_pretrained(WanPipeline, model_id, dtype).to(device)

    def encode(prompt: str) -> torch.Tensor:
        return pipe.encode_prompt(prompt, do_classifier_free_guidance=False, device=device, dtype=dtype)[0]

    return pipe.transformer, pipe.vae, encode


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


def main(argv=None) -> str:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and args.model_id else torch.float32
    transformer, vae, encode = load_models(args.model_id, args.seed, device, dtype)
    transformer.eval()

    # Choose the engine before the first context: installation registers into it.
    engine = RollingKVCacheEngine(args.window_frames, sink_frames=args.sink_frames, positions=args.positions)
    transformer.kv_cache_engines = {"main": engine}
    transformer.set_attn_processor(CausalWanAttnProcessor())

    switch_at = args.num_chunks // 2 if args.switch_at is None else args.switch_at
    g = torch.Generator(device).manual_seed(args.seed)
    stream = StreamingRollout(transformer, encode(args.prompt).to(device, dtype), chunk_frames=args.chunk_frames,
                              timesteps=args.timesteps, generator=g)
    shape = (1, transformer.config.out_channels, args.chunk_frames, args.height // 8, args.width // 8)
    print(f"{engine!r}; RoPE table: {transformer.rope.max_seq_len} positions; "
          f"{args.num_chunks} chunks of {args.chunk_frames} latent frames; prompt switch at chunk {switch_at}")

    chunks, memory, began = [], [], time.perf_counter()
    for i in range(args.num_chunks):
        if i == switch_at:
            stream.switch_prompt(encode(args.switch_prompt).to(device, dtype))
            print(f"chunk {i:4d}: switched prompt to {args.switch_prompt!r}; re-cached frames "
                  + ", ".join(f"{r.start}..{r.stop - 1}" for r in engine.held_frames("pos")))
        noise = torch.randn(shape, generator=g, device=device, dtype=dtype)
        chunks.append(stream.generate(noise).latents)
        memory.append(engine.memory_bytes())
        if (i + 1) % args.memory_every == 0 or i + 1 == args.num_chunks:
            print(f"chunk {i:4d}: {stream.next_frame:5d} latent frames, cache memory_bytes()={memory[-1]} "
                  f"(+{stream.memory_bytes() - memory[-1]} B of window latents), "
                  f"{(time.perf_counter() - began) / (i + 1) * 1000:.1f} ms/chunk")
    rollout_seconds = time.perf_counter() - began
    flat = "flat" if len(set(memory)) == 1 else f"NOT flat: {min(memory)}..{max(memory)}"
    print(f"cache memory over {args.num_chunks} chunks: {flat}; rollout {rollout_seconds:.1f} s")

    frames = decode_latents(vae, torch.cat(chunks, dim=2))
    export_to_video(list(frames), args.output, fps=args.fps)
    print(f"wrote {len(frames)} frames of {frames.shape[2]}x{frames.shape[1]} to {args.output}"
          + ("" if args.model_id else " (random weights: the video is noise; pass --model-id for a real checkpoint)"))
    return args.output


if __name__ == "__main__":
    main()
