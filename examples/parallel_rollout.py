"""Causal generation on several GPUs with ``torchrun``: diffusers' context parallelism (``causal_cp_plan``) and
classifier-free guidance across ranks (``CFGAcrossRanks``), for ``CausalWanPipeline.__call__`` and ``.stream()``.

    # 8 GPUs, Wan2.1 14B at 720p with guidance: 2 guidance ranks x 4 context-parallel ranks
    torchrun --nproc-per-node 8 examples/parallel_rollout.py --cfg-parallel \\
        --model-id <causal-pipeline-folder> --height 720 --width 1280 --num-frames 81 --guidance-scale 5
    # 2 GPUs, a few-step causal model without guidance: 2 context-parallel ranks, streamed chunk by chunk
    torchrun --nproc-per-node 2 examples/parallel_rollout.py --stream --model-id <causal-pipeline-folder>

Every rank runs the same script with the same seed; rank 0 writes the mp4. Ranks split each latent frame's rows
(the latent height must be a multiple of ranks x 2) and the attention heads (their number must divide by the
context-parallel degree: 12 heads of Wan 1.3B take 2, 3, 4 or 6 ranks, 40 heads of 14B take 2, 4, 5, 8).
By default every component is tiny and random (a CPU run with gloo works too: tests/test_parallel.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from diffusers.utils import export_to_video

from diffusers_causal_kv import CausalConfig, CausalWanPipeline, CFGAcrossRanks, causal_cp_plan
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None,
                        help="a diffusers-format causal pipeline (folder or hub id); default: tiny random components")
    parser.add_argument("--cfg-parallel", action="store_true",
                        help="run the 'pos' and 'neg' passes on two halves of the ranks (needs --guidance-scale)")
    parser.add_argument("--stream", action="store_true", help="pipe.stream() instead of pipe()")
    parser.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    parser.add_argument("--negative-prompt", default="blurry, low quality")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--num-frames", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="parallel_rollout.mp4")
    return parser.parse_args(argv)


def setup(cfg_parallel: bool):
    """Join the process group; return this rank's device, its context-parallel config (or ``None``) and its
    guidance-across-ranks helper (or ``None``)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not cfg_parallel:
        return device, (ContextParallelConfig(ulysses_degree=world) if world > 1 else None), None
    if world % 2:
        raise SystemExit(f"error: --cfg-parallel needs an even number of ranks, got {world}.")
    mesh = dist.device_mesh.init_device_mesh(device.type, (2, 1, world // 2), mesh_dim_names=("cfg", "ring", "ulysses"))
    cp = ContextParallelConfig(ulysses_degree=world // 2, mesh=mesh["ring", "ulysses"]) if world > 2 else None
    return device, cp, CFGAcrossRanks(mesh["cfg"].get_group(), commit_group=dist.group.WORLD)


def load_pipeline(model_id: str | None, seed: int, device: torch.device) -> CausalWanPipeline:
    if model_id is None:
        transformer = tiny_wan(seed=seed, ffn_dim=64, init=None)
        config = CausalConfig(chunk_frames=3, timesteps=(1000, 750, 500, 250), shift=5.0, num_frames=33)
        pipe = CausalWanPipeline(**tiny_pipeline_components(transformer, seed=seed), causal_config=config)
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        pipe = CausalWanPipeline.from_pretrained(model_id, dtype=dtype)
    return pipe.to(device)


def main(argv=None) -> None:
    args = parse_args(argv)
    device, cp, cfg = setup(args.cfg_parallel)
    try:
        pipe = load_pipeline(args.model_id, args.seed, device)
        if cp is not None:
            pipe.transformer.enable_parallelism(config=cp, cp_plan=causal_cp_plan(pipe.transformer))
        generator = torch.Generator(device).manual_seed(args.seed)  # the same noise on every rank
        call = {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "height": args.height,
                "width": args.width, "num_frames": args.num_frames, "guidance_scale": args.guidance_scale,
                "generator": generator}
        with cfg if cfg is not None else contextlib.nullcontext():
            if args.stream:
                frames = [f for chunk in pipe.stream(**call) for f in chunk.frames[0]]
            else:
                frames = list(pipe(**call).frames[0])
        if dist.get_rank() == 0:
            export_to_video(frames, args.output, fps=16)
            print(f"wrote {args.output}: {len(frames)} frames from {dist.get_world_size()} ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
