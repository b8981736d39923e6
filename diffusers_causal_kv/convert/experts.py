"""The two experts of a Wan2.2 A14B checkpoint, found in one folder.

Wan2.2's A14B models denoise with two transformers: the high-noise expert above a boundary timestep, the low-noise
expert below it. Their releases keep both in one folder, named

* ``transformer/`` and ``transformer_2/`` in diffusers pipelines (Wan-AI/Wan2.2-I2V-A14B-Diffusers, FastVideo's
  CausalWan2.2-I2V-A14B), whose ``model_index.json`` lists both;
* ``high_noise_model/`` and ``low_noise_model/`` in the original Wan2.2 releases (Wan-AI/Wan2.2-I2V-A14B, its
  ``wan/configs`` naming them ``high_noise_checkpoint`` and ``low_noise_checkpoint``),

each expert a folder of (sharded) safetensors, or one ``<name>.safetensors`` file beside the other. The converter
writes them as ``transformer/`` and ``transformer_2/``, where diffusers' Wan pipelines load them.
"""

from __future__ import annotations

import json
import os

EXPERT_NAMES = (("transformer", "transformer_2"), ("high_noise_model", "low_noise_model"))
OUT_NAMES = EXPERT_NAMES[0]
ROLES = ("high-noise", "low-noise")


def expert_sources(folder: str) -> tuple[str, str] | None:
    """The high- and low-noise experts' paths in ``folder``, or ``None`` when it holds no two-expert checkpoint (a
    diffusers pipeline with one ``transformer/`` is a one-model folder); refuses a folder holding one expert only."""
    for names in EXPERT_NAMES:
        found = [_source(folder, name) for name in names]
        if all(found):
            return found[0], found[1]
        one_model_pipeline = names == OUT_NAMES and found[0] and not _lists_second_expert(folder)
        if any(found) and not one_model_pipeline:
            present, missing = (0, 1) if found[0] else (1, 0)
            raise ValueError(
                f"{folder} holds the {ROLES[present]} expert {found[present]} but not the {ROLES[missing]} expert "
                f"({names[missing]}/ or {names[missing]}.safetensors): a Wan2.2 A14B checkpoint holds two experts, "
                f"{names[0]} and {names[1]}; download both."
            )
    return None


def _source(folder: str, name: str) -> str | None:
    path = os.path.join(folder, name)
    if os.path.isdir(path):
        return path
    return path + ".safetensors" if os.path.isfile(path + ".safetensors") else None


def _lists_second_expert(folder: str) -> bool:
    """Whether the folder's ``model_index.json`` names a ``transformer_2`` component (diffusers writes ``[null,
    null]`` for pipelines without one)."""
    try:
        with open(os.path.join(folder, "model_index.json")) as f:
            entry = json.load(f).get("transformer_2")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(entry, list) and bool(entry) and entry[0] is not None
