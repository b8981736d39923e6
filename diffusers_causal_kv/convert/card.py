"""The model card of a converted folder: ``README.md`` with the YAML front matter the Hugging Face Hub reads.

Written from what the converter knows and nothing else: the metadata diffusers writes for its own models
(``library_name: diffusers``, ``tags``; huggingface_hub's ``ModelCardData``), the ``pipeline_tag`` the input channels
imply (image-to-video when the transformer takes condition latents, else text-to-video), the source files and the
entry converted, the format and why it was chosen, the architecture read off the weights, the sampling settings
written to ``causal_config.json``, and the command that made the folder. ``base_model`` names the official Wan
release (its ``-Diffusers`` repo) whose architecture the weights have, and only when exactly one release has it
(:data:`WAN_RELEASES`); a model of another size gets none.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import diffusers
from huggingface_hub import ModelCardData

from ..causal_config import CausalConfig
from .peers import PeerFormat

CARD_NAME = "README.md"

# The official Wan releases by (experts, layers, width, ffn width, in channels, out channels, image embedder width):
# wan/configs/wan_*.py of Wan-AI/Wan2.1 and Wan-AI/Wan2.2. Wan2.1-I2V-14B is left out: its 480P and 720P releases
# share one architecture, so the weights cannot say which it is.
WAN_RELEASES = {
    (1, 30, 1536, 8960, 16, 16, None): "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    (1, 40, 5120, 13824, 16, 16, None): "Wan-AI/Wan2.1-T2V-14B-Diffusers",
    (1, 30, 3072, 14336, 48, 48, None): "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    (2, 40, 5120, 13824, 16, 16, None): "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    (2, 40, 5120, 13824, 36, 16, None): "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
}


@dataclass(frozen=True)
class Conversion:
    """What a conversion read and wrote, for its card."""

    peer: PeerFormat
    reason: str
    """Why ``peer`` was chosen (the format given, or the name that named it)."""
    sources: Sequence[str]
    """The files converted, each with the entry taken from it (``file['generator_ema']``)."""
    models: Mapping[str, Mapping]
    """Subfolder (``""`` for the folder itself) -> the ``WanTransformer3DModel`` config written there."""
    sampling: CausalConfig
    command: str
    lora_adapter: bool = False


def base_model(models: Mapping[str, Mapping]) -> str | None:
    """The official Wan release with the architecture of ``models`` (one, or the two experts), if exactly one has it."""
    config = next(iter(models.values()))
    key = (len(models), config["num_layers"], config["num_attention_heads"] * config["attention_head_dim"],
           config["ffn_dim"], config["in_channels"], config["out_channels"], config.get("image_dim"))
    return WAN_RELEASES.get(key)


def model_card(conversion: Conversion) -> str:
    """The text of ``README.md``."""
    models, peer, sampling = conversion.models, conversion.peer, conversion.sampling
    config = next(iter(models.values()))
    base = base_model(models)
    image_to_video = config["in_channels"] != config["out_channels"] or config.get("image_dim") is not None
    data = ModelCardData(library_name="diffusers", base_model=base,
                         pipeline_tag="image-to-video" if image_to_video else "text-to-video",
                         tags=["diffusers-causal-kv", "causal", "autoregressive", "wan", peer.name.replace("_", "-")])
    layout = ("two experts, `transformer/` (high noise) and `transformer_2/` (low noise), each"
              if len(models) == 2 else "one `WanTransformer3DModel`")
    architecture = (f"{config['num_layers']} layers, {config['num_attention_heads']} heads of "
                    f"{config['attention_head_dim']}, FFN {config['ffn_dim']}, {config['in_channels']} input and "
                    f"{config['out_channels']} output channels"
                    + (f", image embeddings of {config['image_dim']}" if config.get("image_dim") else ""))
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {peer.title}, converted for diffusers",
        "",
        f"A causal (chunk-by-chunk) Wan video model: {layout} that stock "
        "`diffusers.WanTransformer3DModel.from_pretrained` loads, and `causal_config.json`, the sampling settings "
        "below. Run it chunk by chunk with a KV cache with "
        "[diffusers-causal-kv](https://github.com/diffusers-causal-kv/diffusers-causal-kv).",
        "",
        f"- **Converted from**: {', '.join(f'`{source}`' for source in conversion.sources)}",
        f"- **Format**: `{peer.name}` ({peer.title}): {conversion.reason}",
        f"- **Architecture** (read off the weights): {architecture}"
        + (f"; that of [{base}](https://huggingface.co/{base})" if base else ""),
    ]
    if conversion.lora_adapter:
        lines.append("- **LoRA**: kept apart as a switchable adapter, `pytorch_lora_weights.safetensors`")
    lines += ["", "## Sampling settings (`causal_config.json`)", "", "| key | value |", "| --- | --- |"]
    lines += [f"| `{key}` | `{json.dumps(value)}` |" for key, value in sampling.to_dict().items()]
    subfolder = next(iter(models))
    load = f', subfolder="{subfolder}"' if subfolder else ""
    lines += [
        "", "## Use", "", "```python", "from diffusers import WanTransformer3DModel",
        "from diffusers_causal_kv import CausalConfig", "",
        'folder = "<this folder or its Hub repo id>"',
        f"transformer = WanTransformer3DModel.from_pretrained(folder{load})",
        "sampling = CausalConfig.load(folder)  # or CausalWanPipeline.from_pipe(pipe, causal_config=...)",
        "```", "", "## How it was made", "", "```bash", conversion.command, "```", "",
        f"Made with diffusers {diffusers.__version__}" + _package_version() + ".", "",
    ]
    return "\n".join(lines)


def write_model_card(folder: str, conversion: Conversion) -> str:
    """Write ``README.md`` into ``folder``; returns its path."""
    path = os.path.join(folder, CARD_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(model_card(conversion))
    return path


def _package_version() -> str:
    try:
        return f" and diffusers-causal-kv {importlib.metadata.version('diffusers-causal-kv')}"
    except importlib.metadata.PackageNotFoundError:
        return ""
