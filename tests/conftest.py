"""Shared fixtures (``make_engine`` runs a test once per KV-cache engine) and the hypothesis profile of CI."""

import os

import pytest
from hypothesis import settings

import diffusers_causal_kv.model.install
from diffusers_causal_kv import StaticKVCacheEngine, VanillaKVCacheEngine

# CI explores the same examples on every run (a red run then reproduces); locally hypothesis searches anew each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Enough frames for every rollout in the tests (their RoPE tables have at most 32 positions).
STATIC_MAX_FRAMES = 32

ENGINES = {
    "vanilla": VanillaKVCacheEngine,
    "static": lambda: StaticKVCacheEngine(max_frames=STATIC_MAX_FRAMES),
}


@pytest.fixture(params=sorted(ENGINES), ids=lambda name: f"engine={name}")
def make_engine(request, monkeypatch):
    """A factory of fresh engines of one kind, which is also the default engine installation creates, so every
    transformer the test builds runs on it."""
    factory = ENGINES[request.param]
    monkeypatch.setattr(diffusers_causal_kv.model.install, "KVCacheEngine", factory)
    return factory
