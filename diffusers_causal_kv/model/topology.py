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

    Weights count by content: each K/V projection tensor contributes a checksum of its bits (:func:`weight_digest`),
    so replacing a Parameter object by an equal one (accelerate's sequential CPU offload does it on every forward)
    or moving it between devices changes nothing, while any edit (in place, an optimizer step, ``load_state_dict``,
    assigning another Parameter, quantized or not) does. PEFT LoRA injection swaps the submodule, ``set_adapters``
    changes its active adapters and scaling, ``fuse_lora``/``unfuse_lora`` its merged adapters, and a forward's
    ``attention_kwargs={"scale": s}`` scales the LoRA layers for that forward only (``lora_scale``, counted when a
    K/V projection has LoRA layers). Not seen: writes through ``param.data``, and in-place edits of weights created
    under ``torch.inference_mode()`` (inference tensors have no version counter).
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
            state.append(weight_digest(_kv_weights(module)))
    if has_lora:
        state.append(("lora scale", float(lora_scale)))
    return tuple(state)


def _kv_weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a forward of ``module`` computes with: its parameters, or, under accelerate's offloading (which
    leaves ``meta`` placeholders, replaced on every forward), the offloaded copies it loads them from."""
    tensors = []
    for sub in (module.modules() if module._modules else (module,)):
        source = _offloaded_weights(sub)
        for name, param in sub._parameters.items():
            if param is not None:
                tensors.append(source[name] if source is not None and name in source else param)
    return tensors


def _offloaded_weights(module: torch.nn.Module):
    """The ``weights_map`` of an accelerate ``AlignDevicesHook`` that offloads ``module``'s weights, else ``None``."""
    hook = module.__dict__.get("_hf_hook")
    for h in getattr(hook, "hooks", (hook,)):
        if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
            return h.weights_map
    return None


# A tensor's checksum is remembered on the tensor itself while it holds the same TensorImpl (_cdata) at the same
# version (bumped by every in-place edit), so the weights are read again only after a change. An attribute, not a
# weak dictionary: torch.utils.swap_tensors (diffusers' group offloading of torchao weights) refuses a tensor that is
# weakly referenced, and it exchanges the attributes with the contents, so a swapped-in tensor is read again.
_DIGEST_ATTR = "_causal_kv_digest"


def weight_digest(tensors) -> tuple:
    """A checksum of the bits of each tensor (tensor subclasses such as torchao's or quanto's quantized weights by
    their inner tensors), remembered per tensor while it is unchanged; ``meta`` tensors (no data) by identity."""
    digests, pending = [], {}
    for tensor in _plain_tensors(tensors):
        if tensor.is_meta:
            digests.append(("meta", id(tensor), tensor._version))
            continue
        key = (tensor._cdata, -1 if tensor.is_inference() else tensor._version)
        known = tensor.__dict__.get(_DIGEST_ATTR)
        if known is not None and known[0] == key:
            digests.append(known[1])
            continue
        digests.append(None)
        pending[len(digests) - 1] = (tensor, key)
    by_device = {}
    for slot, (tensor, _) in pending.items():
        by_device.setdefault(tensor.device, []).append((slot, _checksum(tensor)))
    for items in by_device.values():  # one host sync per device for every tensor read again
        for (slot, _), value in zip(items, torch.stack([v for _, v in items]).tolist()):
            tensor, key = pending[slot]
            digests[slot] = (tuple(tensor.shape), str(tensor.dtype), value)
            setattr(tensor, _DIGEST_ATTR, (key, digests[slot]))
    return tuple(digests)


def _plain_tensors(tensors):
    for tensor in tensors:
        if not hasattr(tensor, "__tensor_flatten__"):
            yield tensor
            continue
        names, _ = tensor.__tensor_flatten__()
        yield from _plain_tensors(inner for inner in (getattr(tensor, name) for name in names) if inner is not None)


# Words summed per kernel: bounds the int64 scratch (32 MiB) the checksum of a large weight takes on its device.
_CHECKSUM_SLICE = 1 << 22


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of the tensor's bytes, each word weighted by its position (1, 2, ...): exact integer
    arithmetic without overflow of a term, so a change of any one word, or two words exchanged, always changes it."""
    # As a plain tensor: a subclass's torch function (GGUF's parameters) would wrap every intermediate result.
    data = tensor.detach().as_subclass(torch.Tensor).contiguous().reshape(-1).view(torch.uint8)
    words = data.view(torch.int32) if data.numel() % 4 == 0 and data.storage_offset() % 4 == 0 else data
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHECKSUM_SLICE):
        part = words[start:start + _CHECKSUM_SLICE].to(torch.int64)
        ramp = torch.arange(start + 1, start + 1 + part.numel(), device=part.device, dtype=torch.int64)
        total += (part * ramp).sum()
    return total


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
