"""Per-rank memory of a causal Wan rollout on N ranks, computed from the shapes (nothing is measured).

    python benchmarks/parallel_memory.py            # the README table: Wan 1.3B and 14B, 480p and 720p, bf16

Formulas, in bytes, for a rollout of ``F`` latent frames (81 video frames -> 21), ``T`` tokens per latent frame
(480x832 -> 30x52 = 1560; 720x1280 -> 45x80 = 3600), ``L`` layers of width ``D``, FFN width ``Dff``, text
length ``S = 512``, ``b = 2`` bytes (bf16), ``c`` latent frames per chunk, ``N`` context-parallel ranks and
``g`` tags per rank (2 with guidance on one rank, 1 with ``CFGAcrossRanks``):

* weights: the parameter count (from the model built on the meta device) x ``b``, on every rank (context
  parallelism does not shard weights);
* self-attention cache: ``g x L x 2 x F x (T / N) x D x b`` (each rank caches its rows of every frame);
* cross-attention cache: ``g x L x 2 x S x D x b`` (replicated);
* activations of one chunk forward (the largest block-level tensors alive at once, no allocator overhead):
  ``(c x T / N) x (4 x D + Dff) x b`` for the chunk's hidden states, Q, K, V and FFN, plus
  ``2 x (F x T / N) x D x b`` for the prefix-plus-chunk K/V a concatenating engine hands attention (the last
  chunk attends to all ``F`` frames).
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel

GiB = 1024 ** 3
MODELS = {
    "Wan 1.3B": {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30},
    "Wan 14B": {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40},
}
RESOLUTIONS = {"480p": (480, 832), "720p": (720, 1280)}


def parameter_count(config: dict) -> int:
    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    return sum(p.numel() for p in model.parameters())


def per_rank_bytes(config: dict, params: int, height: int, width: int, *, ranks: int, tags_per_rank: int,
                   video_frames: int = 81, chunk_frames: int = 3, text_tokens: int = 512, itemsize: int = 2) -> dict:
    """Bytes per rank of weights, self cache, cross cache and activations (the formulas of the module docstring)."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    layers, ffn = config["num_layers"], config["ffn_dim"]
    frames = (video_frames - 1) // 4 + 1
    tokens = (height // 16) * (width // 16)  # VAE 8x, patch 2x
    local = tokens / ranks
    return {
        "weights": params * itemsize,
        "self cache": tags_per_rank * layers * 2 * frames * local * dim * itemsize,
        "cross cache": tags_per_rank * layers * 2 * text_tokens * dim * itemsize,
        "activations": (chunk_frames * local * (4 * dim + ffn) + 2 * frames * local * dim) * itemsize,
    }


def table() -> str:
    rows = ["| model | video | ranks (CFG x CP) | weights | self cache | cross cache | activations | total |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    layouts = [("1 (CFG on one rank)", 1, 2), ("2 (1 x 2)", 2, 2), ("8 (1 x 8)", 8, 2), ("8 (2 x 4)", 4, 1)]
    for name, config in MODELS.items():
        params = parameter_count(config)
        for video, (height, width) in RESOLUTIONS.items():
            for label, ranks, tags in layouts:
                if config["num_attention_heads"] % ranks:
                    continue  # Ulysses splits the heads: the degree must divide them
                parts = per_rank_bytes(config, params, height, width, ranks=ranks, tags_per_rank=tags)
                cells = [f"{v / GiB:.1f}" for v in parts.values()]
                rows.append(f"| {name} | {video} | {label} | " + " | ".join(cells)
                            + f" | {sum(parts.values()) / GiB:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print("GiB per rank, bf16, 81 frames (21 latent), chunks of 3 latent frames, whole rollout cached:")
    print(table())
