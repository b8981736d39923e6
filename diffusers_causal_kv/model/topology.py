"""What a Wan transformer is made of, as the cache sees it: branches, attention modules, and the state of what
computes cached K/V. One helper answers every "which kind of model is this" question."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The submodules of a WanAttention that compute the K/V an engine caches (unfused, fused and I2V image paths).
_KV_SUBMODULES = ("to_k", "to_v", "norm_k", "to_kv", "to_qkv", "add_k_proj", "add_v_proj", "to_added_kv",
                  "norm_added_k")


@dataclass(frozen=True)
class Topology:
    """The engine branches of a transformer and its kind.

    ``branches`` maps each branch name to the blocks it owns (``"main"``: ``transformer.blocks``; ``"vace"``:
    ``transformer.vace_blocks``, VACE only). ``is_i2v``: Wan2.1 image-to-video (added image K/V projections).
    """

    branches: dict[str, torch.nn.ModuleList]
    is_vace: bool
    is_i2v: bool

    def attention(self) -> list[torch.nn.Module]:
        """Every self- and cross-attention module the branches own, block by block."""
        return [attn for blocks in self.branches.values() for block in blocks for attn in (block.attn1, block.attn2)]

    def registrations(self, branch: str):
        """``(attn, block_idx)`` for every attention module of ``branch``, indices local to the branch."""
        return [(attn, idx) for idx, block in enumerate(self.branches[branch]) for attn in (block.attn1, block.attn2)]


def experts_of(model) -> list[torch.nn.Module]:
    """The transformers of ``model``: ``[transformer]`` of a pipeline or ``[model]``, or ``[transformer,
    transformer_2]`` for a two-expert Wan2.2 (A14B) pipeline (the high-noise expert first)."""
    first = getattr(model, "transformer", model)
    second = getattr(model, "transformer_2", None)
    return [first] if second is None else [first, second]


def topology(transformer: torch.nn.Module) -> Topology:
    branches = {"main": transformer.blocks}
    vace = getattr(transformer, "vace_blocks", None)
    if vace is not None:
        branches["vace"] = vace
    return Topology(branches, vace is not None, transformer.blocks[0].attn2.add_k_proj is not None)


def projection_state(transformer: torch.nn.Module, lora_scale: float = 1.0) -> tuple:
    """The state of everything that computes cached K/V, cheap enough to take on every cached forward.

    In-place updates (optimizer steps, ``param.copy_()`` under ``no_grad``) bump a parameter's ``_version``;
    PEFT LoRA injection swaps the submodule, ``set_adapters`` changes its active adapters and scaling,
    ``fuse_lora``/``unfuse_lora`` its merged adapters, and a forward's ``attention_kwargs={"scale": s}`` scales the
    LoRA layers for that forward only (``lora_scale``, counted when a K/V projection has LoRA layers). Not seen:
    writes through ``param.data``, and in-place edits of weights created under ``torch.inference_mode()`` (inference
    tensors have no version counter).
    """
    state, has_lora = [], False
    for attn in topology(transformer).attention():
        # Read the children straight from _modules: nn.Module.__getattr__ on a missing name raises and catches an
        # AttributeError, and this runs for every K/V submodule of every block on every cached forward.
        for name, module in attn._modules.items():
            if module is None or name not in _KV_SUBMODULES:
                continue
            adapters = _adapter_state(module)
            has_lora = has_lora or bool(adapters)
            state.append((name, id(module), *adapters))
            params = module.parameters() if module._modules else module._parameters.values()
            state.extend((id(param), -1 if param.is_inference() else param._version) for param in params
                         if param is not None)
    if has_lora:
        state.append(("lora scale", float(lora_scale)))
    return tuple(state)


def _adapter_state(module: torch.nn.Module) -> tuple:
    """A PEFT LoRA layer's active and merged adapters, scaling and switch; ``()`` for any other module."""
    module = module._modules.get("_orig_mod") or module  # a LoRA layer wrapped by torch.compile
    scaling = module.__dict__.get("scaling")
    if not isinstance(scaling, dict):
        return ()
    return (
        tuple(getattr(module, "active_adapters", ()) or ()),
        tuple(getattr(module, "merged_adapters", ()) or ()),
        tuple(sorted(scaling.items())),
        bool(getattr(module, "disable_adapters", False)),
    )
