"""KV-cache engines. ``KVCacheEngine`` is the default engine, the vanilla reference.

This package knows tensors only: it imports nothing of ``diffusers_causal_kv`` but the rotary-math leaf.
"""

from .base import BaseKVCacheEngine, owning_engine
from .records import AttentionKV, CrossEntry, PassInfo, StagedChunk, TagInfo
from .rolling_engine import RollingKVCacheEngine
from .static_engine import StaticKVCacheEngine
from .vanilla_engine import VanillaKVCacheEngine

KVCacheEngine = VanillaKVCacheEngine

__all__ = [
    "AttentionKV",
    "BaseKVCacheEngine",
    "CrossEntry",
    "KVCacheEngine",
    "PassInfo",
    "RollingKVCacheEngine",
    "StagedChunk",
    "StaticKVCacheEngine",
    "TagInfo",
    "VanillaKVCacheEngine",
    "owning_engine",
]
