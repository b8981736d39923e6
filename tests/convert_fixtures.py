"""Tiny checkpoints in the exact layouts the peers ship, built from tiny diffusers models (for tests/test_convert.py
and the converter cases of tests/test_error_catalogue.py).

The original Wan key names come from inverting diffusers' own rename table (read out of
``convert_wan_transformer_to_diffusers``, not retyped): a diffusers key's original is the name from which the most
renames lead to it, so names the table leaves alone are not mistaken for originals.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import textwrap

import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file

from diffusers_causal_kv.testing import tiny_conditioning, tiny_wan

HEADS = 2  # the tiny models' head count, which conversion cannot infer (their head dim is not Wan's 128)


@functools.cache
def _rename_pairs() -> list[tuple[str, str]]:
    source = textwrap.dedent(inspect.getsource(convert_wan_transformer_to_diffusers))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TRANSFORMER_KEYS_RENAME_DICT":
            return list(ast.literal_eval(node.value).items())
    raise AssertionError("diffusers' Wan rename table moved")


def _to_diffusers(key: str) -> str:
    return next(iter(convert_wan_transformer_to_diffusers({key: None})))


@functools.cache
def original_key(key: str) -> str:
    """The original Wan name of diffusers key ``key``: of the names diffusers renames to ``key``, the one reached by
    undoing the most specific renames (the most renamed text), so that the table's generic renames ("norm3" ->
    "norm2") lose to its specific ones ("img_emb.proj.4" -> "condition_embedder.image_embedder.norm2")."""
    candidates = {key: 0}  # candidate -> characters of renamed text undone
    for old, new in reversed(_rename_pairs()):
        for candidate, undone in list(candidates.items()):
            if new in candidate:
                candidates.setdefault(candidate.replace(new, old), undone + len(new))
    valid = {c: n for c, n in candidates.items() if _to_diffusers(c) == key and "__placeholder" not in c}
    most = max(valid.values())
    best = [c for c, n in valid.items() if n == most]
    if len(best) > 1:
        # The table is many-to-one twice with equally specific renames: "head.modulation" and the blocks'
        # "modulation" both become "scale_shift_table", "head.head" and VACE's "after_proj" both "proj_out".
        # Outside the blocks these keys belong to Wan's head.
        best = [c for c in best if ("head." in c) != key.startswith("blocks.")]
    assert len(best) == 1, (key, best)
    return best[0]


def original_state_dict(model, prefix: str = "") -> dict[str, torch.Tensor]:
    """``model``'s weights under their original Wan names (cloned, so each file owns its tensors)."""
    return {prefix + original_key(k): v.detach().clone() for k, v in model.state_dict().items()}


def wrapper_state(model, inner: str = "") -> dict[str, torch.Tensor]:
    """The state dict of a peer's ``WanDiffusionWrapper`` around ``model``: ``model.<inner><original key>``."""
    return original_state_dict(model, prefix=f"model.{inner}")


def save_pt(path, obj) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path)
    return str(path)


def write_wrapper(path, generator, generator_ema=None, extra: dict | None = None, inner: str = "") -> str:
    """A Self-Forcing / Causal-Forcing / CausVid / LongLive training checkpoint: ``{"generator", ["generator_ema"],
    "critic", ...}``."""
    state = {"generator": wrapper_state(generator, inner), "critic": wrapper_state(tiny_wan(seed=99), inner)}
    if generator_ema is not None:
        state["generator_ema"] = wrapper_state(generator_ema, inner)
    state.update(extra or {})
    return save_pt(path, state)


def write_safetensors_shards(folder, state: dict[str, torch.Tensor], shards: int = 2,
                             name: str = "diffusion_pytorch_model") -> str:
    """``state`` as the official Wan2.1 shards plus their index json; returns the index's path."""
    os.makedirs(folder, exist_ok=True)
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"{name}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k].contiguous() for k in part}, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    index = os.path.join(folder, f"{name}.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index


def lora_targets(model) -> list[str]:
    """The LongLive LoRA targets in diffusers names: every linear layer of the transformer blocks."""
    return [name for name, module in model.named_modules()
            if name.startswith("blocks.") and isinstance(module, torch.nn.Linear)]


def add_random_lora(model, rank: int = 4, alpha: float = 4.0, seed: int = 5) -> None:
    """A PEFT LoRA adapter named ``"default"`` on every LongLive target of ``model``, with random A and B."""
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=lora_targets(model)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def longlive_lora_file(path, model) -> str:
    """LongLive's ``lora.pt`` for the PEFT adapter on ``model``: PEFT's state dict of its ``CausalWanModel``
    (``base_model.model.<original module>.lora_A.weight``) under ``generator_lora``."""
    from peft.utils import get_peft_model_state_dict

    state = {}
    for key, tensor in get_peft_model_state_dict(model).items():
        module, _, part = key.rpartition(".lora_")
        original = original_key(f"{module}.weight").removesuffix(".weight")
        state[f"base_model.model.{original}.lora_{part}"] = tensor.detach().clone()
    critic = {key: torch.zeros_like(tensor) for key, tensor in state.items()}  # the critic's LoRA, never converted
    return save_pt(path, {"generator_lora": state, "critic_lora": critic, "step": 100})


def inputs(model, seed: int = 3):
    """Forward kwargs for ``model``: 2 latent frames of 4x4, a timestep, the conditioning."""
    g = torch.Generator().manual_seed(seed)
    text, image = tiny_conditioning(model, batch=1)
    x = torch.randn(1, model.config.in_channels, 2, 4, 4, generator=g)
    kwargs = dict(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)
    if image is not None:
        kwargs["encoder_hidden_states_image"] = image
    return kwargs


@torch.no_grad()
def output(model, kwargs) -> torch.Tensor:
    return model(**kwargs)[0]


# ---------------------------------------------------------------------------------------------- Wan2.2 A14B experts
def write_diffusers_experts(folder, high, low, max_shard_size="10GB") -> str:
    """A diffusers pipeline folder of two experts (FastVideo's CausalWan2.2-I2V-A14B layout): ``transformer/``,
    ``transformer_2/`` and a ``model_index.json`` listing both."""
    os.makedirs(folder, exist_ok=True)
    high.save_pretrained(os.path.join(folder, "transformer"), max_shard_size=max_shard_size)
    low.save_pretrained(os.path.join(folder, "transformer_2"), max_shard_size=max_shard_size)
    write_model_index(folder)
    return str(folder)


def write_model_index(folder, second_expert: bool = True) -> None:
    index = {"_class_name": "WanImageToVideoPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"] if second_expert else [None, None]}
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f)


def write_original_experts(folder, high, low) -> str:
    """The official Wan2.2 A14B layout: ``high_noise_model/`` and ``low_noise_model/``, sharded original keys."""
    write_safetensors_shards(os.path.join(folder, "high_noise_model"), original_state_dict(high))
    write_safetensors_shards(os.path.join(folder, "low_noise_model"), original_state_dict(low))
    return str(folder)


def fp8_scaled_state(model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(ComfyUI scaled-fp8 state dict of model, the dequantized weights under diffusers names)``: every block
    linear weight stored as ``float8_e4m3fn`` with a float32 ``scale_weight`` and a ``scale_input``, plus the
    ``scaled_fp8`` marker; the rest as it is."""
    state = original_state_dict(model)
    dequantized = {}
    for name, module in model.named_modules():
        if not (name.startswith("blocks.") and isinstance(module, torch.nn.Linear)):
            continue
        key = original_key(f"{name}.weight")
        weight = state[key]
        scale = weight.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
        quantized = (weight / scale).to(torch.float8_e4m3fn)
        state[key] = quantized
        state[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        state[key.removesuffix(".weight") + ".scale_input"] = torch.ones(())
        dequantized[f"{name}.weight"] = quantized.float() * scale
    state["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return state, dequantized


def lora_state_file(path, model) -> str:
    """The PEFT adapter on ``model`` as a flat LoRA safetensors of original Wan names under ``diffusion_model.``
    (``diffusion_model.blocks.0.self_attn.q.lora_A.weight``), as Wan2.2 expert LoRAs ship."""
    from peft.utils import get_peft_model_state_dict

    state = {}
    for key, tensor in get_peft_model_state_dict(model).items():
        module, _, part = key.rpartition(".lora_")
        original = original_key(f"{module}.weight").removesuffix(".weight")
        state[f"diffusion_model.{original}.lora_{part}"] = tensor.detach().clone().contiguous()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(state, path)
    return str(path)
