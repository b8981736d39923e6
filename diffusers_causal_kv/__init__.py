"""Causal, chunk-by-chunk generation with a KV cache for the stock diffusers Wan transformers."""

from .context import CausalContext, get_current_context
from .kv_cache import BaseKVCacheEngine, KVCacheEngine, StaticKVCacheEngine, VanillaKVCacheEngine
from .model import clear_caches, uninstall_causal_kv
from .processors import CausalWanAttnProcessor
from .rollout import RolloutOutput, causal_rollout, chunk_schedule

__all__ = [
    "BaseKVCacheEngine",
    "CausalContext",
    "CausalWanAttnProcessor",
    "KVCacheEngine",
    "RolloutOutput",
    "StaticKVCacheEngine",
    "VanillaKVCacheEngine",
    "causal_rollout",
    "chunk_schedule",
    "clear_caches",
    "get_current_context",
    "uninstall_causal_kv",
]
