"""Activation memory per chunk of a self-forcing rollout, with and without gradient checkpointing.

Counts the bytes autograd saves for ``backward()`` (through ``torch.autograd.graph.saved_tensors_hooks``, weights
excluded, each storage once) while :func:`diffusers_causal_kv.self_forcing_rollout` runs, and attributes them to
the chunk whose forward saved them. Exact and device independent, so it runs on a CPU:

    python benchmarks/training_memory.py --size small

prints a table and a JSON line. The grad-enabled step of each chunk attends over the cached prefix, so without
checkpointing the saved bytes of a chunk grow with the prefix it attends to (the attention inputs) on top of a
per-chunk constant (every block's activations); with checkpointing only each block's inputs are kept, and the
recomputation in ``backward()`` rebuilds the rest one block at a time.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from diffusers import WanTransformer3DModel

from diffusers_causal_kv import CausalWanAttnProcessor, self_forcing_rollout
from diffusers_causal_kv.ambient import running_pass
from diffusers_causal_kv.testing import tiny_wan

SIZES = {
    # name: (layers, heads, head_dim, latent height/width, latent frames, chunk frames)
    "tiny": (2, 2, 12, 8, 6, 2),
    "small": (4, 4, 32, 16, 9, 3),
    "medium": (8, 8, 64, 24, 12, 3),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--exit-step", type=int, default=1, help="denoising step that keeps gradients")
    return parser.parse_args(argv)


def build(size: str) -> tuple[WanTransformer3DModel, tuple, int]:
    layers, heads, head_dim, side, frames, chunk = SIZES[size]
    model = tiny_wan(head_dim=head_dim, heads=heads, layers=layers, seed=0, rope_max_seq_len=64, init=None,
                     text_dim=64, freq_dim=64, ffn_dim=4 * heads * head_dim)  # diffusers' own initialisation
    return model, (1, 16, frames, side, side), chunk


def saved_bytes_per_chunk(model, shape, chunk: int, exit_step: int) -> dict[int, int]:
    """Bytes saved for backward by each chunk's forward (keyed by the chunk's start frame)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, per_chunk = set(), defaultdict(int)

    def pack(tensor):
        storage = tensor.untyped_storage()
        p = running_pass()
        if p is not None and storage.data_ptr() not in weights and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            per_chunk[p.info.start_frame] += storage.nbytes()
        return tensor

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(shape, generator=g)
    text = torch.randn(1, 16, model.config.text_dim, generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = self_forcing_rollout(model, noise, text, exit_step=exit_step, chunk_frames=chunk, generator=g)
    result.latents.square().mean().backward()  # the graph is complete and usable
    return dict(per_chunk)


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = {"size": args.size, "chunks": []}
    rows = {}
    for checkpointing in (False, True):
        model, shape, chunk = build(args.size)
        model.set_attn_processor(CausalWanAttnProcessor())
        model.train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        rows[checkpointing] = saved_bytes_per_chunk(model, shape, chunk, args.exit_step)
    layers, heads, head_dim, side, frames, chunk = SIZES[args.size]
    print(f"preset {args.size}: {layers} layers, {heads} heads x {head_dim}, latents {frames}x{side}x{side}, "
          f"chunks of {chunk}, batch 1, fp32, exit step {args.exit_step}")
    print(f"{'chunk start':>11} | {'saved, plain (MiB)':>18} | {'saved, checkpointing (MiB)':>26}")
    for start in sorted(rows[False]):
        plain, ckpt = rows[False][start], rows[True].get(start, 0)
        print(f"{start:>11} | {plain / 2**20:>18.2f} | {ckpt / 2**20:>26.2f}")
        report["chunks"].append({"start_frame": start, "saved_bytes": plain, "saved_bytes_checkpointing": ckpt})
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
