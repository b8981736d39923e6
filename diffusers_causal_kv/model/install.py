"""Installation: the engine branches on the transformer, module registration, the hooks, and their removal.

``transformer.kv_cache_engines`` maps branch names to engines (see :mod:`.topology`). Installation completes when
the first :class:`~diffusers_causal_kv.CausalContext` opens after ``transformer.set_attn_processor(
CausalWanAttnProcessor())``: it creates the missing engines, registers each attention module with the engine of its
branch, and adds two named diffusers hooks, ``causal_kv`` on the transformer (:mod:`.hook`) and
``causal_kv_rope_positions`` on ``transformer.rope`` (:mod:`diffusers_causal_kv.positions`).

Every open scans the attention modules (diffusers gives no notice when one module's processor is replaced), but an
engine map is registered once, and again only when the scan finds a replaced module or processor.

Hook order with diffusers' own hooks: a hook registered later wraps the ones registered before it. Ours are
registered when the first context opens, so the transformer hook wraps hooks applied earlier and is wrapped by hooks
applied later; the RoPE hook is the exception, always innermost (below). Cache hooks
(``transformer.enable_cache(...)``) live on the blocks and attention modules, inside our transformer hook, so either
order works; a ``store_kv=True`` forward is refused before any work while a hook that may skip blocks is registered.
Group offloading works in either order, at block and at leaf level. Leaf-level offloading also hooks
``transformer.rope`` to onload its buffers, and that hook must wrap ours (our RoPE hook computes the tables without
calling the forward it wraps): the RoPE hook is therefore always installed innermost on ``transformer.rope``, under
hooks registered before it as well as after (:func:`~diffusers_causal_kv.positions.install_rope_hook` moves it there
when the first context opens).
"""

from __future__ import annotations

import functools
import weakref

import torch
from diffusers.hooks import HookRegistry
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from ..ambient import current_context
from ..kv_cache import BaseKVCacheEngine, KVCacheEngine
from ..positions import ROPE_HOOK_NAME, install_rope_hook
from ..processors import CausalWanAttnProcessor
from ..sharding import check_split, context_parallel_config
from .checkpointing import unroute_checkpointing
from .hook import HOOK_NAME, CausalForwardHook
from .topology import Topology, experts_of, topology

# engine -> (transformer id, branch, module/processor signature) it was registered with.
_REGISTERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_transformer(
    transformer: torch.nn.Module, cache_engines: dict[str, BaseKVCacheEngine] | None = None
) -> dict[str, BaseKVCacheEngine]:
    """Complete installation and return the engine map a context uses (validated and registered)."""
    _rebuild_copied_hooks(transformer)
    kind = topology(transformer)
    attention = kind.attention()
    installed = [isinstance(attn.processor, CausalWanAttnProcessor) for attn in attention]
    if not any(installed):
        raise RuntimeError(
            f"{type(transformer).__name__} has no CausalWanAttnProcessor installed; call "
            "transformer.set_attn_processor(CausalWanAttnProcessor()) before opening a CausalContext."
        )
    if not all(installed):
        raise RuntimeError(
            f"{installed.count(False)} of {len(installed)} attention modules of {type(transformer).__name__} do not "
            "use CausalWanAttnProcessor, so their blocks would ignore the cache; install it on all of them with "
            "transformer.set_attn_processor(CausalWanAttnProcessor())."
        )
    check_split(transformer)
    # Processors installed after enable_parallelism() did not get its config, which sends self-attention through
    # diffusers' Ulysses path: hand it to them.
    parallel = transformer._parallel_config if context_parallel_config(transformer) is not None else None
    for attn in attention:
        attn.processor._parallel_config = parallel
    if transformer.config.patch_size[0] != 1:
        raise ValueError(
            f"patch_size={tuple(transformer.config.patch_size)} patches {transformer.config.patch_size[0]} latent "
            "frames together; the causal cache counts latent frames one by one and needs a temporal patch size of 1 "
            "(every Wan checkpoint uses (1, 2, 2))."
        )
    defaults = getattr(transformer, "kv_cache_engines", None)
    if defaults is None:
        defaults = transformer.kv_cache_engines = {}
    if not isinstance(defaults, dict) or not set(defaults) <= set(kind.branches):
        got = sorted(defaults) if isinstance(defaults, dict) else type(defaults).__name__
        example = ", ".join(f"{b!r}: KVCacheEngine()" for b in kind.branches)
        raise ValueError(
            f"transformer.kv_cache_engines must be a dict from branch names {sorted(kind.branches)} to engines, got "
            f"{got}; e.g. transformer.kv_cache_engines = {{{example}}}."
        )
    # A branch the user left out gets an empty engine of the kind the user chose (same window, sink, positions),
    # so that every branch follows one rule; the default engine when the user chose none.
    given = next(iter(defaults.values()), None)
    for branch in kind.branches:
        if branch not in defaults:
            defaults[branch] = KVCacheEngine() if given is None else given.empty_like()
    # The transformer's own map is always complete and registered; a per-session map is validated in full first.
    maps = [defaults] if cache_engines is None else [defaults, cache_engines]
    signature = (id(transformer), tuple((id(attn), id(attn.processor)) for attn in attention))
    for engines in maps:
        _check_engine_map(engines, kind, signature)
    for engines in maps:
        for branch, engine in engines.items():
            if _REGISTERED.get(engine) != (branch, signature):
                for attn, block_idx in kind.registrations(branch):
                    engine.register_module(attn, block_idx)
                _REGISTERED[engine] = (branch, signature)
    _install_hooks(transformer)
    return maps[-1]


def resolve_engines(transformer: torch.nn.Module, cache_engines: dict | None = None) -> dict[str, BaseKVCacheEngine]:
    """The engine map a rollout reads and writes: ``cache_engines``, else the transformer's own (empty before the
    first context created it)."""
    return cache_engines if cache_engines is not None else getattr(transformer, "kv_cache_engines", None) or {}


def _check_engine_map(cache_engines: dict, kind: Topology, signature: tuple) -> None:
    branches = kind.branches
    if not isinstance(cache_engines, dict) or set(cache_engines) != set(branches):
        got = sorted(cache_engines) if isinstance(cache_engines, dict) else type(cache_engines).__name__
        raise ValueError(
            f"cache_engines must map exactly the branches {sorted(branches)} to engines, got {got}; e.g. "
            + "{" + ", ".join(f"{b!r}: KVCacheEngine()" for b in branches) + "}."
        )
    for branch, engine in cache_engines.items():
        if not isinstance(engine, BaseKVCacheEngine):
            raise TypeError(
                f"cache_engines[{branch!r}] is a {type(engine).__name__}, not a KV-cache engine; use "
                "KVCacheEngine() or another BaseKVCacheEngine subclass."
            )
    if len({id(e) for e in cache_engines.values()}) != len(cache_engines):
        raise ValueError(
            "One engine object serves several branches of cache_engines; block indices are local to a branch, "
            "so each branch needs its own engine instance."
        )
    for branch, engine in cache_engines.items():
        registered = _REGISTERED.get(engine)
        if registered == (branch, signature):
            continue  # registered for this branch, and nothing changed since
        if registered is not None and registered[1][0] != signature[0] and engine.tags():
            raise ValueError(
                f"The engine of branch {branch!r} holds the cache of another transformer (tags {engine.tags()}); "
                "give each transformer its own engines, or clear() this one before moving it."
            )
        foreign = [other for other in branches if other != branch
                   for attn, _ in kind.registrations(other) if engine.owns(attn)]
        if foreign:
            raise ValueError(
                f"The engine of branch {branch!r} already registered modules of branch {foreign[0]!r}; give each "
                "branch its own engine."
            )


def _rebuild_copied_hooks(transformer: torch.nn.Module) -> None:
    """``copy.deepcopy`` of a transformer copies diffusers' hook registries, but the forward they installed still
    closes over the original's hook chain (and runs the original's weights). A copy whose only hooks are ours has
    them removed here and installed anew; a copy with other hooks is refused."""
    for module, name in ((transformer, HOOK_NAME), (transformer.rope, ROPE_HOOK_NAME)):
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None or registry.get_hook(name) is None or _runs_own_hooks(module, registry):
            continue
        if registry._hook_order != [name]:
            raise RuntimeError(
                f"this {type(module).__name__} is a copy (copy.deepcopy) of a module with the diffusers hooks "
                f"{registry._hook_order}, whose forward still runs the original's; copy the transformer before "
                "installing hooks on it (or uninstall them from the original first), then install on each."
            )
        registry.remove_hook(name, recurse=False)


def _runs_own_hooks(module: torch.nn.Module, registry) -> bool:
    forward = module.__dict__.get("forward")
    if not isinstance(forward, functools.partial) or not registry._fn_refs:
        return True  # not a forward diffusers' registry installed
    return any(cell.cell_contents is registry._fn_refs[-1] for cell in forward.func.__closure__ or ())


def _install_hooks(transformer: torch.nn.Module) -> None:
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    # Our hook validates and describes the forward the caller passed, so it wraps the input split and output gather
    # of context parallelism (diffusers' hooks named "cp_..."), also when enable_parallelism() came after it.
    if registry.get_hook(HOOK_NAME) is not None and any(
            name.startswith("cp_") for name in registry._hook_order[registry._hook_order.index(HOOK_NAME):]):
        registry.remove_hook(HOOK_NAME, recurse=False)
    if registry.get_hook(HOOK_NAME) is None:
        registry.register_hook(CausalForwardHook(), HOOK_NAME)
    install_rope_hook(transformer)


def clear_caches(model: torch.nn.Module) -> None:
    """Clear every engine on ``transformer.kv_cache_engines`` (call at the start of each rollout); ``model`` is a
    transformer or a pipeline, whose every expert (Wan2.2 A14B: ``transformer`` and ``transformer_2``) is cleared."""
    transformers = experts_of(model)
    for transformer in transformers:  # every expert checked before any is cleared
        if not any(isinstance(attn.processor, CausalWanAttnProcessor) for attn in topology(transformer).attention()):
            raise RuntimeError(
                f"{type(transformer).__name__} has no CausalWanAttnProcessor installed, so it has no KV cache to "
                "clear; call transformer.set_attn_processor(CausalWanAttnProcessor()) first."
            )
    for transformer in transformers:
        for engine in resolve_engines(transformer).values():
            engine.clear()


def uninstall_causal_kv(transformer: torch.nn.Module) -> None:
    """Restore the stock ``WanAttnProcessor`` everywhere, remove the hooks and drop ``kv_cache_engines``."""
    if current_context(transformer) is not None:
        raise RuntimeError("uninstall_causal_kv() called inside a CausalContext of this transformer; close it first.")
    _rebuild_copied_hooks(transformer)
    for attn in topology(transformer).attention():
        if isinstance(attn.processor, CausalWanAttnProcessor):
            stock = WanAttnProcessor()
            stock._attention_backend = attn.processor._attention_backend
            stock._parallel_config = attn.processor._parallel_config
            attn.set_processor(stock)
    for module, name in ((transformer, HOOK_NAME), (transformer.rope, ROPE_HOOK_NAME)):
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(name) is not None:
            registry.remove_hook(name, recurse=False)
    unroute_checkpointing(transformer)
    if hasattr(transformer, "kv_cache_engines"):
        del transformer.kv_cache_engines
