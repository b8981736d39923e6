"""Engine bookkeeping: crop, exact memory_bytes, repr, and the verbs of the reference README."""

import pytest
import torch
from helpers import conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalWanAttnProcessor, KVCacheEngine, StaticKVCacheEngine, VanillaKVCacheEngine


@pytest.fixture
def model():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _commit(model, start, frames, tag="pos", seed=0):
    text, _ = conditioning(model, seed=1 if tag == "pos" else 2)
    x = torch.randn(2, 16, frames, 4, 4, generator=torch.Generator().manual_seed(seed))
    return forward(model, x, torch.zeros(2), text, start_frame=start, store_kv=True, cache_tag=tag)


def _held_frames(engine, cached):
    """Frames of self K/V an engine holds for a tag with ``cached`` frames (the static engine: all it allocated)."""
    return engine.max_frames if isinstance(engine, StaticKVCacheEngine) else cached


def test_vanilla_keeps_a_list_of_chunks(model):
    assert KVCacheEngine is VanillaKVCacheEngine
    _commit(model, 0, 2)
    _commit(model, 2, 1, seed=1)
    entry = model.kv_cache_engines["main"]._self_kv[0]["pos"]
    assert [k.shape[1] for k in entry.keys] == [8, 4] and entry.len == 12
    key, value = model.kv_cache_engines["main"].get_self_prefix(0, "pos")
    assert key.shape == value.shape == (2, 12, 2, 12)


def test_memory_bytes_is_exact(model, make_engine):
    engine = model.kv_cache_engines = {"main": make_engine()}
    engine = engine["main"]
    assert engine.memory_bytes() == 0
    _commit(model, 0, 3)
    blocks, batch, heads, head_dim, text_len = 2, 2, 2, 12, 12
    frame_bytes = blocks * 2 * batch * 4 * heads * head_dim * 4  # K and V of one frame (4 tokens), fp32
    cross_bytes = blocks * 2 * batch * text_len * heads * head_dim * 4
    assert engine.memory_bytes() == _held_frames(engine, 3) * frame_bytes + cross_bytes
    _commit(model, 0, 2, tag="neg")
    held = _held_frames(engine, 3) + _held_frames(engine, 2)
    assert engine.memory_bytes() == held * frame_bytes + 2 * cross_bytes


def test_crop_drops_newest_frames_and_continues(model, make_engine):
    engine = model.kv_cache_engines = {"main": make_engine()}
    engine = engine["main"]
    _commit(model, 0, 2)
    prefix_two = [t.clone() for t in engine.get_self_prefix(1, "pos")]
    _commit(model, 2, 3, seed=1)
    full_bytes = engine.memory_bytes()
    engine.crop(-3)
    assert engine.num_frames("pos") == 2 and engine.next_frame("pos") == 2
    assert all(torch.equal(a, b) for a, b in zip(engine.get_self_prefix(1, "pos"), prefix_two))
    dropped = _held_frames(engine, 5) - _held_frames(engine, 2)
    assert engine.memory_bytes() == full_bytes - dropped * (2 * 2 * 2 * 4 * 2 * 12 * 4)
    # Re-committing the dropped chunk gives the same cache (and outputs) as never having cropped it.
    out = _commit(model, 2, 3, seed=1)
    engine.crop(4)  # mid-chunk crop
    assert engine.num_frames("pos") == 4
    assert engine._self_kv[0]["pos"].len == 16
    assert out.shape[2] == 3
    with pytest.raises(ValueError, match=r"between -4 and 4"):
        engine.crop(5)
    with pytest.raises(ValueError, match=r"between -4 and 4"):
        engine.crop(-5, cache_tag="pos")
    assert engine.num_frames("pos") == 4


def test_crop_then_recommit_matches_uncropped(model, make_engine):
    text, _ = conditioning(model)
    ref_model = tiny_wan()
    ref_model.set_attn_processor(CausalWanAttnProcessor())
    x0, x1, x2 = (torch.randn(2, 16, 1, 4, 4, generator=torch.Generator().manual_seed(s)) for s in range(3))
    for m, chunks in ((model, (x0, torch.randn(2, 16, 1, 4, 4), x1)), (ref_model, (x0, x1))):
        for start, x in enumerate(chunks):
            if m is model and start == 2:
                m.kv_cache_engines["main"].crop(-1)
                start = 1
            forward(m, x, torch.zeros(2), text, start_frame=start, store_kv=True)
    a = forward(model, x2, torch.full((2,), 300.0), text, start_frame=2)
    b = forward(ref_model, x2, torch.full((2,), 300.0), text, start_frame=2)
    assert torch.equal(a, b)


def test_crop_validates_every_tag_before_cropping(model, make_engine):
    engine = model.kv_cache_engines = {"main": make_engine()}
    engine = engine["main"]
    _commit(model, 0, 3)
    _commit(model, 0, 1, tag="neg")
    with pytest.raises(ValueError, match="'neg', which holds 1 frames"):
        engine.crop(2)
    assert engine.num_frames("pos") == 3 and engine.num_frames("neg") == 1


def test_repr_is_readable(model, make_engine):
    engine = model.kv_cache_engines = {"main": make_engine()}
    engine = engine["main"]
    _commit(model, 0, 2)
    text = repr(engine)
    assert text.startswith(f"{type(engine).__name__}(") and "blocks=2" in text
    assert "'pos': 2 frames x 4 tokens, batch 2, cross filled" in text and "MiB" in text
