"""Misuse raises a clear error naming the fix, before any work, and leaves the cache exactly as it was."""

import pytest
import torch
from helpers import assert_same_snapshot, cache_snapshot, conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, KVCacheEngine

pytestmark = pytest.mark.usefixtures("make_engine")  # run every test on each engine

T = torch.tensor([500.0, 500.0])


@pytest.fixture
def setup():
    """A T2V model whose 'pos' tag holds 2 committed frames (batch 2), with a counter on the patch embedding."""
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    for start in (0, 1):
        forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=start, store_kv=True)
    calls = []
    model.patch_embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    return model, text, calls


def _expect_error(setup, match, x, t=T, text=None, image=None, error=ValueError, **ctx):
    model, default_text, calls = setup
    before = cache_snapshot(model)
    with pytest.raises(error, match=match):
        forward(model, x, t, default_text if text is None else text, image, **ctx)
    assert calls == [], "the error must come before any work"
    assert_same_snapshot(before, cache_snapshot(model))


@pytest.mark.parametrize("store_kv", [False, True], ids=["denoise", "commit"])
@pytest.mark.parametrize("start", [1, 3, 0], ids=["overlap", "gap", "restart"])
def test_start_frame_must_continue_the_cache(setup, start, store_kv):
    _expect_error(setup, rf"holds 2 frames but start_frame={start}.*pass start_frame=2",
                  torch.randn(2, 16, 1, 4, 4), start_frame=start, store_kv=store_kv)


def test_start_frame_checked_per_tag(setup):
    # 'neg' holds nothing yet, so it must start at 0 even though 'pos' holds 2 frames.
    _expect_error(setup, r"'neg' holds 0 frames but start_frame=2.*start_frame=0",
                  torch.randn(2, 16, 1, 4, 4), start_frame=2, cache_tag="neg")


def test_negative_start_frame():
    with pytest.raises(ValueError, match="start_frame must be >= 0"):
        CausalContext(tiny_wan(), start_frame=-1)


def test_batch_size_mismatch(setup):
    text = setup[1][:1]
    _expect_error(setup, r"batch size 2 but this forward has 1.*clear_caches\(\)",
                  torch.randn(1, 16, 1, 4, 4), torch.tensor([500.0]), text=text, start_frame=2)


def test_dtype_mismatch(setup):
    _expect_error(setup, r"dtype torch.float32 but this forward has torch.float64.*clear_caches\(\)",
                  torch.randn(2, 16, 1, 4, 4, dtype=torch.float64), start_frame=2)


def test_device_mismatch(setup):
    _expect_error(setup, r"device cpu but this forward has meta.*clear_caches\(\)",
                  torch.randn(2, 16, 1, 4, 4, device="meta"), start_frame=2)


def test_frame_size_mismatch(setup):
    _expect_error(setup, r"tokens per latent frame 4 but this forward has 16",
                  torch.randn(2, 16, 1, 8, 8), start_frame=2)


def test_conditioning_with_other_length(setup):
    text = torch.randn(2, 7, setup[1].shape[2])
    _expect_error(setup, r"other conditioning.*clear_caches\(\)", torch.randn(2, 16, 1, 4, 4), text=text,
                  start_frame=2)


def test_conditioning_with_same_shape_other_values(setup):
    text = setup[1].clone()
    text[1, 3, 5] += 1e-3
    _expect_error(setup, r"other conditioning", torch.randn(2, 16, 1, 4, 4), text=text, start_frame=2)


@pytest.mark.parametrize("shape, name", [((2, 16, 1, 5, 4), "height 5"), ((2, 16, 1, 4, 3), "width 3")])
def test_height_width_not_divisible_by_patch(setup, shape, name):
    _expect_error(setup, rf"latent {name} is not divisible by the patch size 2", torch.randn(*shape), start_frame=2)


def test_temporal_patch_other_than_one_is_refused():
    model = tiny_wan(patch_size=(2, 2, 2))
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    with pytest.raises(ValueError, match=r"needs a temporal patch size of 1"):
        forward(model, torch.randn(2, 16, 2, 4, 4), T, text, start_frame=0)


def test_discontinuous_start_frame_is_reported_before_the_rope_range(setup):
    # 40 is past the 32-position RoPE table too, but the cause to report is the gap in the cache.
    _expect_error(setup, "holds 2 frames but start_frame=40; call clear_caches", torch.randn(2, 16, 1, 4, 4),
                  start_frame=40)


def test_engine_map_that_is_not_a_dict():
    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    model.kv_cache_engines = KVCacheEngine()
    with pytest.raises(ValueError, match="kv_cache_engines must be a dict from branch names"):
        CausalContext(model).__enter__()


@pytest.mark.parametrize("text_shape, match", [
    ((2, 12, 7), r"must be a \[batch, tokens, 32\] tensor"),
    ((3, 12, 32), "has batch 3 but the latents have batch 2"),
])
def test_malformed_text_embeddings(setup, text_shape, match):
    _expect_error(setup, match, torch.randn(2, 16, 1, 4, 4), text=torch.randn(*text_shape), start_frame=2)


def test_chunk_beyond_rope_table():
    model = tiny_wan(rope_max_seq_len=4)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    forward(model, torch.randn(2, 16, 3, 4, 4), torch.zeros(2), text, start_frame=0, store_kv=True)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=r"frames 3..4 but the RoPE table has 4 positions"):
        forward(model, torch.randn(2, 16, 2, 4, 4), T, text, start_frame=3, store_kv=True)
    assert_same_snapshot(before, cache_snapshot(model))


def test_context_without_processors():
    model = tiny_wan()
    with pytest.raises(RuntimeError, match=r"set_attn_processor\(CausalWanAttnProcessor\(\)\)"), CausalContext(model):
        pass
    assert not hasattr(model, "kv_cache_engines")


def test_partially_installed_processors():
    model = tiny_wan()
    model.blocks[1].attn1.set_processor(CausalWanAttnProcessor())
    with pytest.raises(RuntimeError, match=r"3 of 4 attention modules"), CausalContext(model):
        pass


@pytest.mark.parametrize("bad, match", [
    (lambda text: dict(timestep=torch.zeros(2, 3)), r"timestep has shape \(2, 3\)"),
    (lambda text: dict(encoder_hidden_states=text[:1].expand(3, -1, -1)), r"encoder_hidden_states has batch 3"),
])
def test_malformed_inputs(setup, bad, match):
    model, text, calls = setup
    kwargs = dict(hidden_states=torch.randn(2, 16, 1, 4, 4), timestep=T, encoder_hidden_states=text)
    kwargs.update(bad(text))
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=match), torch.no_grad(), CausalContext(model, start_frame=2):
        model(**kwargs)
    assert calls == []
    assert_same_snapshot(before, cache_snapshot(model))


def test_i2v_conditioning_checks():
    model = tiny_wan(i2v=True)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, image = conditioning(model)
    x = torch.randn(2, model.config.in_channels, 1, 4, 4)
    with pytest.raises(ValueError, match="pass encoder_hidden_states_image"):
        forward(model, x, T, text, None, start_frame=0)
    with pytest.raises(ValueError, match="pad the prompt embeddings to 512"):
        forward(model, x, T, text[:, :100], image, start_frame=0)
    with pytest.raises(ValueError, match=r"encoder_hidden_states_image must be a \[batch, tokens, 8\] tensor"):
        forward(model, x, T, text, image[:, :, :4], start_frame=0)
    with pytest.raises(ValueError, match=r"with batch 2 \(or 1\)"):
        forward(model, x, T, text, torch.cat([image, image]), start_frame=0)
    t2v = tiny_wan()
    t2v.set_attn_processor(CausalWanAttnProcessor())
    with pytest.raises(ValueError, match="drop the image embeddings"):
        forward(t2v, torch.randn(2, 16, 1, 4, 4), T, conditioning(t2v)[0], image, start_frame=0)


def test_exception_inside_forward_commits_nothing(setup):
    model, text, _ = setup
    before = cache_snapshot(model)

    def explode(*_):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=2, store_kv=True)
    handle.remove()
    assert_same_snapshot(before, cache_snapshot(model))
    forward(model, torch.randn(2, 16, 1, 4, 4), torch.zeros(2), text, start_frame=2, store_kv=True)
    assert model.kv_cache_engines["main"].num_frames("pos") == 3
