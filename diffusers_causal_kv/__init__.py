"""Causal, chunk-by-chunk generation with a KV cache for the stock diffusers Wan transformers."""

from .context import CausalContext, get_current_context
from .kv_cache import (
    BaseKVCacheEngine,
    KVCacheEngine,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
)
from .masks import CausalMask, block_causal_mask, chunk_schedule, teacher_forcing_mask
from .model import clear_caches, uninstall_causal_kv
from .planner import RolloutPlanner
from .processors import CausalWanAttnProcessor
from .rollout import RolloutOutput, causal_rollout, self_forcing_rollout
from .streaming import StreamingRollout, prefill, recache

__all__ = [
    "BaseKVCacheEngine",
    "CausalContext",
    "CausalMask",
    "CausalWanAttnProcessor",
    "KVCacheEngine",
    "RollingKVCacheEngine",
    "RolloutOutput",
    "RolloutPlanner",
    "StaticKVCacheEngine",
    "StreamingRollout",
    "VanillaKVCacheEngine",
    "block_causal_mask",
    "causal_rollout",
    "chunk_schedule",
    "clear_caches",
    "get_current_context",
    "prefill",
    "recache",
    "self_forcing_rollout",
    "teacher_forcing_mask",
    "uninstall_causal_kv",
]
