"""KV-cache engines. ``KVCacheEngine`` is the default engine, the vanilla reference."""

from .base import BaseKVCacheEngine, CrossEntry, TagInfo
from .rolling_engine import RollingKVCacheEngine
from .static_engine import StaticKVCacheEngine
from .vanilla_engine import VanillaKVCacheEngine

KVCacheEngine = VanillaKVCacheEngine

__all__ = [
    "BaseKVCacheEngine",
    "CrossEntry",
    "KVCacheEngine",
    "RollingKVCacheEngine",
    "StaticKVCacheEngine",
    "TagInfo",
    "VanillaKVCacheEngine",
]
