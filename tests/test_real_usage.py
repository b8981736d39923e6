"""Regressions for defects found by using the plugin as users do (issue 13): each returns the right result against a
reference computed another way, or the package's own clear error before any state changes."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    VACE_CHANNELS,
    assert_same_snapshot,
    block_causal_mask,
    cache_snapshot,
    conditioning,
    forward,
    masked_full_forward,
    tiny_vace,
    tiny_wan,
)
from peft import LoraConfig

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    KVCacheEngine,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    causal_rollout,
    clear_caches,
)

H = W = 4
FRAME_TOKENS = 4
ROLLOUT = dict(chunk_frames=1, timesteps=(1000, 500), progress=False)


def _rollout(model, noise, text, **kwargs):
    """causal_rollout with a fresh seeded generator, so that twin rollouts re-noise alike."""
    return causal_rollout(model, noise, text, generator=torch.Generator().manual_seed(7), **{**ROLLOUT, **kwargs})


def _installed(model, engines=None):
    if engines is not None:
        model.kv_cache_engines = engines
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _noise(frames=3, batch=2, channels=16, seed=0):
    return torch.randn(batch, channels, frames, H, W, generator=torch.Generator().manual_seed(seed))


def _masked_reference(model, chunks, t, text, image=None, **extra):
    """The last chunk of one stock forward over every chunk, block-causal, committed chunks at t=0."""
    sizes = [c.shape[2] for c in chunks]
    batch = chunks[0].shape[0]
    per_token = torch.cat([torch.zeros(batch, sum(sizes[:-1]) * FRAME_TOKENS),
                           torch.full((batch, sizes[-1] * FRAME_TOKENS), float(t))], dim=1)
    with torch.no_grad():
        out = masked_full_forward(model, torch.cat(chunks, dim=2), per_token, text, image,
                                  block_causal_mask(sizes, FRAME_TOKENS), **extra)
    return out[:, :, sum(sizes[:-1]):]


# 1. Inference tensors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_tensor_prompts_roll_out_like_normal_ones(mode):
    model = _installed(tiny_wan())
    text, _ = conditioning(model)
    negative = torch.randn_like(text)
    expected = _rollout(model, _noise(), text, negative_prompt_embeds=negative, guidance_scale=3.0).latents
    with torch.inference_mode():
        text_inf, negative_inf = text.clone(), negative.clone()
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        got = _rollout(model, _noise(), text_inf, negative_prompt_embeds=negative_inf, guidance_scale=3.0).latents
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    engine = model.kv_cache_engines["main"]
    assert engine.num_frames("pos") == engine.num_frames("neg") == 3
    with torch.inference_mode():  # another inference-tensor prompt is refused, never read against stale K/V
        other = torch.randn_like(text)
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match="built from other conditioning"):
        forward(model, _noise(1), torch.zeros(2), other, start_frame=3)
    assert_same_snapshot(before, cache_snapshot(model))


def test_model_created_under_inference_mode_rolls_out():
    reference = _installed(tiny_wan())
    with torch.inference_mode():
        model = _installed(tiny_wan())
        text, _ = conditioning(model)
        got = _rollout(model, _noise(), text).latents
    expected = _rollout(reference, _noise(), text.clone()).latents
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# 2. LoRA strength per forward ----------------------------------------------------------------------------------------
def _lora_model():
    model = _installed(tiny_wan())
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False), adapter_name="style")
    return model


def test_lora_scale_per_forward_is_part_of_the_projection_state():
    model = _lora_model()
    text, _ = conditioning(model)
    chunks = [_noise(1, seed=s) for s in range(2)]
    half = {"scale": 0.5}
    forward(model, chunks[0], torch.zeros(2), text, start_frame=0, store_kv=True)  # filled at scale 1
    before = cache_snapshot(model)
    for store_kv in (False, True):
        with pytest.raises(RuntimeError, match="projection weights changed"):
            forward(model, chunks[1], torch.zeros(2), text, extra={"attention_kwargs": half}, start_frame=1,
                    store_kv=store_kv)
    assert_same_snapshot(before, cache_snapshot(model))
    # A rollout at one scale throughout equals the masked stock forward at that scale.
    clear_caches(model)
    forward(model, chunks[0], torch.zeros(2), text, extra={"attention_kwargs": half}, start_frame=0, store_kv=True)
    cached = forward(model, chunks[1], torch.full((2,), 500.0), text, extra={"attention_kwargs": half},
                     start_frame=1)
    reference = _masked_reference(model, chunks, 500.0, text, attention_kwargs=half)
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5)
    at_full_scale = _masked_reference(model, chunks, 500.0, text)
    assert not torch.allclose(reference, at_full_scale, atol=1e-3)  # the scale matters numerically


# 3. Copies of a transformer ------------------------------------------------------------------------------------------
def test_deepcopy_after_the_first_context_is_an_independent_causal_model():
    model = _installed(tiny_wan())
    text, _ = conditioning(model)
    _rollout(model, _noise(), text)
    original = cache_snapshot(model)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for param in ema.parameters():  # an EMA or critic copy has weights of its own
            param.mul_(0.9)
    with pytest.raises(RuntimeError, match=r"copy \(copy.deepcopy\)"):  # its copied hooks would run the original
        forward(ema, _noise(1), torch.zeros(2), text)
    assert_same_snapshot(original, cache_snapshot(model))
    twin = _installed(tiny_wan())
    with torch.no_grad():
        for mine, theirs in zip(twin.parameters(), ema.parameters()):
            mine.copy_(theirs)
    got = _rollout(ema, _noise(), text).latents  # its first context rebuilds its own hooks
    torch.testing.assert_close(got, _rollout(twin, _noise(), text).latents, rtol=0, atol=0)
    assert ema.kv_cache_engines["main"] is not model.kv_cache_engines["main"]
    assert_same_snapshot(original, cache_snapshot(model))  # the original's cache never saw the copy
    stock = copy.deepcopy(ema)
    from diffusers_causal_kv import uninstall_causal_kv
    uninstall_causal_kv(stock)  # also rebuilds a copy: it then runs its own stock forward
    with torch.no_grad():
        out = stock(hidden_states=_noise(1), timestep=torch.zeros(2), encoder_hidden_states=text)[0]
        uninstall_causal_kv(twin)
        ref = twin(hidden_states=_noise(1), timestep=torch.zeros(2), encoder_hidden_states=text)[0]
    assert torch.equal(out, ref)


# 5. Gradient checkpointing and a second backward -------------------------------------------------------------------
def test_checkpointed_second_backward_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = _installed(tiny_wan(layers=3))
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        text, _ = conditioning(model)
        forward(model, _noise(1, seed=3), torch.zeros(2), text, start_frame=0, store_kv=True)
        with CausalContext(model, start_frame=1):
            out = model(hidden_states=_noise(1), timestep=torch.full((2,), 600.0), encoder_hidden_states=text,
                        return_dict=False)[0]
        loss = out.square().mean()
        loss.backward(retain_graph=True)
        loss.backward()  # recomputes the checkpointed blocks a second time
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


# 6. clear_caches() leaves nothing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [KVCacheEngine, lambda: StaticKVCacheEngine(8), lambda: RollingKVCacheEngine(3, 1)],
                         ids=["vanilla", "static", "rolling"])
def test_clear_then_another_dtype_and_tag_churn(make):
    model = _installed(tiny_wan(), {"main": make()})
    text, _ = conditioning(model)
    _rollout(model, _noise(), text)
    clear_caches(model)
    model.to(torch.bfloat16)  # the documented fix for "was built with dtype"
    bf16 = _rollout(model, _noise().bfloat16(), text.bfloat16()).latents
    assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16).all()
    model.to(torch.float32)
    engine = model.kv_cache_engines["main"]
    sizes = set()
    for request in range(6):  # a new tag per request, cleared in between: memory does not grow
        clear_caches(model)
        assert engine.memory_bytes() == 0 and engine.tags() == []
        forward(model, _noise(1), torch.zeros(2), text, start_frame=0, store_kv=True, cache_tag=f"req{request}")
        sizes.add(engine.memory_bytes())
    assert len(sizes) == 1


# 7. Static engine and inference tensors ------------------------------------------------------------------------------
def test_static_buffers_from_inference_mode_are_written_by_a_later_no_grad_pass():
    static, vanilla = (_installed(tiny_wan(), {"main": e}) for e in (StaticKVCacheEngine(8), KVCacheEngine()))
    text, _ = conditioning(static)
    outputs = []
    for model in (static, vanilla):
        with torch.inference_mode():
            forward(model, _noise(1, seed=1), torch.zeros(2), text, start_frame=0, store_kv=True)
        outputs.append(forward(model, _noise(1, seed=2), torch.full((2,), 500.0), text, start_frame=1))
        forward(model, _noise(1, seed=2), torch.zeros(2), text, start_frame=1, store_kv=True)
        outputs.append(forward(model, _noise(1, seed=4), torch.full((2,), 500.0), text, start_frame=2))
    torch.testing.assert_close(outputs[0], outputs[2], rtol=0, atol=1e-6)
    torch.testing.assert_close(outputs[1], outputs[3], rtol=0, atol=1e-6)


# 8. VACE engine maps -------------------------------------------------------------------------------------------------
def _control(frames):
    return torch.randn(1, VACE_CHANNELS, frames, H, W, generator=torch.Generator().manual_seed(5))


def test_vace_session_map_naming_only_main_fails_before_clearing():
    model = _installed(tiny_vace())
    text, _ = conditioning(model, batch=1)
    _rollout(model, _noise(2, batch=1), text, control_latents=_control(2))
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match="must map exactly the branches"):
        _rollout(model, _noise(2, batch=1), text, control_latents=_control(2), cache_engines={"main": KVCacheEngine()})
    assert_same_snapshot(before, cache_snapshot(model))


@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_vace_branch_left_out_mirrors_the_main_engine(positions):
    """A kv_cache_engines map naming only "main" gets a "vace" engine of the same kind and window, so the rollout
    equals the one with both engines given (the VACE stream sees the window too, and evicts without failing)."""
    outputs = []
    for engines in ({"main": RollingKVCacheEngine(2, positions=positions)},
                    {"main": RollingKVCacheEngine(2, positions=positions),
                     "vace": RollingKVCacheEngine(2, positions=positions)}):
        model = _installed(tiny_vace(), engines)
        text, _ = conditioning(model, batch=1)
        outputs.append(_rollout(model, _noise(4, batch=1), text, control_latents=_control(4)).latents)
        vace = model.kv_cache_engines["vace"]
        assert isinstance(vace, RollingKVCacheEngine) and (vace.window_frames, vace.positions) == (2, positions)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


# Smaller ones --------------------------------------------------------------------------------------------------------
def test_i2v_image_batch_must_match_the_text_batch():
    model = _installed(tiny_wan(i2v=True))
    text, image = conditioning(model, batch=2)
    with pytest.raises(ValueError, match="concatenates them per sample"):
        forward(model, _noise(1, channels=36), torch.zeros(2), text, image[:1], start_frame=0)


@pytest.mark.parametrize("bad", ["no_timesteps", "no_frames"])
def test_empty_rollouts_fail_before_clearing(bad):
    model = _installed(tiny_wan())
    text, _ = conditioning(model)
    _rollout(model, _noise(), text)
    before = cache_snapshot(model)
    kwargs = {"timesteps": ()} if bad == "no_timesteps" else {}
    with pytest.raises(ValueError, match="timesteps is empty" if bad == "no_timesteps" else "has 0 latent frames"):
        _rollout(model, _noise(0 if bad == "no_frames" else 2), text, **kwargs)
    assert_same_snapshot(before, cache_snapshot(model))


def test_an_engine_serving_two_transformers_is_refused_by_name():
    engine = KVCacheEngine()
    first, second = _installed(tiny_wan(), {"main": engine}), _installed(tiny_wan(seed=1))
    text, _ = conditioning(first)
    _rollout(first, _noise(), text)
    with pytest.raises(ValueError, match="holds the cache of another transformer"):
        _rollout(second, _noise(), text, cache_engines={"main": engine})
    assert engine.num_frames("pos") == 3


def test_autocast_rollout_caches_in_the_autocast_dtype():
    model = _installed(tiny_wan())
    text, _ = conditioning(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _rollout(model, _noise(), text).latents
    assert torch.isfinite(out).all()
    assert model.kv_cache_engines["main"].get_self_prefix(0, "pos")[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="was built with dtype torch.bfloat16"):  # mixing is refused clearly
        forward(model, _noise(1), torch.zeros(2), text, start_frame=3)


def test_embeddings_in_another_dtype_are_cast_to_the_models_as_the_stock_pipelines_do():
    """fp32 prompt embeddings on a bf16 model failed inside its time projection; they are cast, as the stock
    pipelines cast them: the rollout equals one given bf16 embeddings."""
    from diffusers_causal_kv import CausalWanAttnProcessor, causal_rollout
    from diffusers_causal_kv.testing import tiny_conditioning, tiny_wan

    model = tiny_wan().to(torch.bfloat16)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = tiny_conditioning(model, batch=1)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    args = dict(chunk_frames=1, timesteps=[1000, 500], progress=False)
    cast = causal_rollout(model, noise, text.to(torch.bfloat16), generator=torch.Generator().manual_seed(1), **args)
    given = causal_rollout(model, noise, text.float(), generator=torch.Generator().manual_seed(1), **args)
    assert torch.equal(cast.latents, given.latents)
