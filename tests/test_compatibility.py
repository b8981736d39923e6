"""Drop-in compatibility with the diffusers ecosystem: save/load, fused projections, uninstall, diffusers' own
hooks (enable_cache, group offloading) and attention backends, each against a run without them."""

import subprocess
import sys

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.hooks import FirstBlockCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from helpers import assert_same_snapshot, cache_snapshot, conditioning, forward, tiny_wan

from diffusers_causal_kv import CausalWanAttnProcessor, RollingKVCacheEngine, clear_caches, uninstall_causal_kv

H = W = 4
STEPS = (900.0, 500.0)
STALE = "K/V projection weights changed since cache tag 'pos' was filled"


def _chunks(model, num=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, model.config.in_channels, 1, H, W, generator=g) for _ in range(num)]


def _rollout(model, text, chunks, image=None):
    """Denoise every chunk at STEPS against the cache, commit it at t=0; the denoising outputs."""
    clear_caches(model)
    outs = []
    for i, x in enumerate(chunks):
        for t in STEPS:
            with model.cache_context("cond"):  # diffusers' cache hooks key their state by this
                outs.append(forward(model, x, torch.full((2,), t), text, image, start_frame=i))
        forward(model, x, torch.zeros(2), text, image, start_frame=i, store_kv=True)
    return outs


def _assert_close(outs, refs, atol=1e-5):
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=0, atol=atol)


def _installed(**kwargs):
    model = tiny_wan(**kwargs)
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


# ---------------------------------------------------------------------------------------------- save / load
def test_save_pretrained_round_trip(tmp_path):
    model = _installed()
    text, _ = conditioning(model)
    chunks = _chunks(model)
    cached = _rollout(model, text, chunks)  # the cache is filled when saving
    stock = tiny_wan()
    assert model.kv_cache_engines["main"].num_frames("pos") == len(chunks)

    state, stock_state = model.state_dict(), stock.state_dict()
    assert state.keys() == stock_state.keys()
    assert all(torch.equal(state[k], stock_state[k]) for k in state)
    model.save_pretrained(tmp_path)

    loaded = WanTransformer3DModel.from_pretrained(tmp_path).eval()
    assert all(type(p) is WanAttnProcessor for p in loaded.attn_processors.values())
    assert not hasattr(loaded, "kv_cache_engines") and getattr(loaded, "_diffusers_hook", None) is None
    x, t = chunks[0], torch.full((2,), 500.0)
    assert torch.equal(forward(loaded, x, t, text), forward(stock, x, t, text))

    loaded.set_attn_processor(CausalWanAttnProcessor())
    _assert_close(_rollout(loaded, text, chunks), cached, atol=0)


# ---------------------------------------------------------------------------------------------- fused projections
@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_fused_projections(i2v):
    model = _installed(i2v=i2v)
    text, image = conditioning(model)
    chunks = _chunks(model)
    unfused = _rollout(model, text, chunks, image)

    # Fused on a filled cache: the guard sees to_qkv/to_kv (and to_added_kv) appear; the cache is left as it was.
    model.fuse_qkv_projections()
    assert all(block.attn1.fused_projections and block.attn2.fused_projections for block in model.blocks)
    before = cache_snapshot(model)
    with pytest.raises(RuntimeError, match=STALE):
        forward(model, chunks[-1], torch.zeros(2), text, image, start_frame=len(chunks))
    assert_same_snapshot(before, cache_snapshot(model))
    _assert_close(_rollout(model, text, chunks, image), unfused)

    # Edits of the fused weights are seen too.
    fused_kv = model.blocks[0].attn2.to_added_kv if i2v else model.blocks[0].attn2.to_kv
    with torch.no_grad():
        fused_kv.weight.mul_(1.01)
    with pytest.raises(RuntimeError, match=STALE):
        forward(model, chunks[-1], torch.zeros(2), text, image, start_frame=len(chunks))
    with torch.no_grad():
        fused_kv.weight.div_(1.01)

    model.unfuse_qkv_projections()
    with pytest.raises(RuntimeError, match=STALE):
        forward(model, chunks[-1], torch.zeros(2), text, image, start_frame=len(chunks))
    _assert_close(_rollout(model, text, chunks, image), unfused)

    # Fused before the processors are installed, per attention module.
    fused_first = tiny_wan(i2v=i2v)
    for block in fused_first.blocks:
        block.attn1.fuse_projections()
        block.attn2.fuse_projections()
    fused_first.set_attn_processor(CausalWanAttnProcessor())
    _assert_close(_rollout(fused_first, text, chunks, image), unfused)


# ---------------------------------------------------------------------------------------------- enable_cache
def test_first_block_cache_threshold_zero_is_exact_and_commits_are_refused():
    model = _installed(layers=3)
    text, _ = conditioning(model)
    chunks = _chunks(model)
    reference = _rollout(model, text, chunks)
    config = FirstBlockCacheConfig(threshold=0.0)

    clear_caches(model)
    outs = []
    for i, x in enumerate(chunks):
        model.enable_cache(config)
        for t in STEPS:
            with model.cache_context("cond"):
                outs.append(forward(model, x, torch.full((2,), t), text, start_frame=i))
        before = cache_snapshot(model)
        refused = r"store_kv=True forward refused: \['fbc_leader_block_hook'\].*disable_cache"
        with pytest.raises(RuntimeError, match=refused), model.cache_context("cond"):
            forward(model, x, torch.zeros(2), text, start_frame=i, store_kv=True)
        assert_same_snapshot(before, cache_snapshot(model))
        model.disable_cache()  # the fix the error names
        forward(model, x, torch.zeros(2), text, start_frame=i, store_kv=True)
    _assert_close(outs, reference)


@pytest.mark.parametrize("config", [
    lambda: FirstBlockCacheConfig(threshold=10.0),  # skips every block after the first
    lambda: PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                            spatial_attention_timestep_skip_range=(0, 1000),
                                            current_timestep_callback=lambda: 500),
    lambda: TaylorSeerCacheConfig(cache_identifiers=[r"blocks\.\d+\.attn1"], cache_interval=2,
                                  disable_cache_before_step=1, taylor_factors_dtype=torch.float32),
], ids=["first_block_cache", "pyramid_attention_broadcast", "taylorseer"])
@pytest.mark.parametrize("order", ["before_first_context", "after_first_context"])
def test_block_skipping_cache_hooks_run_denoising_and_refuse_commits(config, order):
    model = _installed(layers=3)
    text, _ = conditioning(model)
    x = _chunks(model, num=1)[0]
    if order == "after_first_context":
        forward(model, x, torch.zeros(2), text, start_frame=0)
    model.enable_cache(config())
    for t in STEPS:  # denoising forwards run, with whatever approximation the config implies
        with model.cache_context("cond"):
            assert forward(model, x, torch.full((2,), t), text, start_frame=0).isfinite().all()
    with pytest.raises(RuntimeError, match="store_kv=True forward refused.*disable_cache"), model.cache_context("cond"):
        forward(model, x, torch.zeros(2), text, start_frame=0, store_kv=True)
    assert model.kv_cache_engines["main"].tags() == []


def test_uninstall_keeps_diffusers_cache_hooks():
    model = tiny_wan(layers=3)
    text, _ = conditioning(model)
    x, t = _chunks(model, num=1)[0], torch.full((2,), 500.0)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    # A fresh cache context name per forward: first block cache then runs every block (no state to reuse).
    with model.cache_context("stock"):
        stock = forward(model, x, t, text)
    model.set_attn_processor(CausalWanAttnProcessor())
    with model.cache_context("causal"):
        forward(model, x, torch.zeros(2), text, start_frame=0)
    uninstall_causal_kv(model)
    assert model.is_cache_enabled and model._diffusers_hook.get_hook("causal_kv") is None
    with model.cache_context("uninstalled"):
        assert torch.equal(forward(model, x, t, text), stock)


# ---------------------------------------------------------------------------------------------- group offloading
CPU = torch.device("cpu")


@pytest.mark.parametrize("offload", [
    dict(offload_type="block_level", num_blocks_per_group=1),
    dict(offload_type="block_level", num_blocks_per_group=2, low_cpu_mem_usage=True),
    dict(offload_type="leaf_level"),
], ids=["block_level", "block_level_low_cpu_mem", "leaf_level"])
@pytest.mark.parametrize("order", ["before_first_context", "after_first_context"])
def test_group_offloading(offload, order):
    model = _installed()
    text, _ = conditioning(model)
    chunks = _chunks(model)
    reference = _rollout(model, text, chunks)

    model = _installed()
    if order == "after_first_context":
        forward(model, chunks[0], torch.zeros(2), text, start_frame=0)
    model.enable_group_offload(onload_device=CPU, offload_device=CPU, **offload)
    _assert_close(_rollout(model, text, chunks), reference, atol=0)


@pytest.mark.parametrize("order", ["before_first_context", "after_first_context"])
def test_leaf_level_offloading_to_disk(order, tmp_path):
    # On disk, an offloaded buffer is emptied: the RoPE tables must be computed inside the onloading hook.
    model = _installed()
    text, _ = conditioning(model)
    chunks = _chunks(model)
    reference = _rollout(model, text, chunks)
    model = _installed()
    if order == "after_first_context":
        forward(model, chunks[0], torch.zeros(2), text, start_frame=0)
    model.enable_group_offload(onload_device=CPU, offload_device=CPU, offload_type="leaf_level",
                               offload_to_disk_path=str(tmp_path))
    _assert_close(_rollout(model, text, chunks), reference, atol=0)


@pytest.mark.parametrize("offload_type", ["leaf_level", "block_level"])
@pytest.mark.parametrize("order", ["before_first_context", "after_first_context"])
def test_offloading_to_disk_with_relative_positions(offload_type, order, tmp_path):
    # A relative rolling engine rotates the cached prefix with the model's temporal RoPE rows at read time: they are
    # taken while rope's buffers are onloaded (inside the RoPE hook), not when the pass is built.
    def rolling(model):
        model.kv_cache_engines = {"main": RollingKVCacheEngine(2, positions="relative")}
        return model

    model = rolling(_installed())
    text, _ = conditioning(model)
    chunks = _chunks(model, num=4)
    reference = _rollout(model, text, chunks)
    model = rolling(_installed())
    if order == "after_first_context":
        forward(model, chunks[0], torch.zeros(2), text, start_frame=0)
    extra = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    model.enable_group_offload(onload_device=CPU, offload_device=CPU, offload_type=offload_type,
                               offload_to_disk_path=str(tmp_path), **extra)
    _assert_close(_rollout(model, text, chunks), reference, atol=0)


# ---------------------------------------------------------------------------------------------- attention backends
# "_native_efficient" and "_native_cudnn" have no CPU kernel ("No viable backend for scaled_dot_product_attention").
CPU_BACKENDS = ["_native_math", "_native_flash", "flex"]


@pytest.fixture
def restore_active_backend():
    # set_attention_backend sets the global active backend too, and reset_attention_backend does not restore it.
    previous = _AttentionBackendRegistry.get_active_backend()[0]
    yield
    _AttentionBackendRegistry.set_active_backend(previous)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_backends_give_native_cached_results(backend, restore_active_backend):
    model = _installed()
    text, _ = conditioning(model)
    chunks = _chunks(model)
    model.set_attention_backend("native")
    native = _rollout(model, text, chunks)
    model.set_attention_backend(backend)
    _assert_close(_rollout(model, text, chunks), native)


def test_import_prints_nothing():
    """``import diffusers_causal_kv`` in a fresh interpreter writes nothing: the optional backends' import noise
    (torchao, bitsandbytes, transformers' torchvision fallback for the CLIP processor) stays out of users' output."""
    run = subprocess.run([sys.executable, "-c", "import diffusers_causal_kv"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert (run.stdout, run.stderr) == ("", ""), run.stderr
