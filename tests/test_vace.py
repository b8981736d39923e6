"""Causal VACE: a "main" and a "vace" engine branch on the stock WanVACETransformer3DModel."""

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
)

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    KVCacheEngine,
    causal_rollout,
    clear_caches,
    uninstall_causal_kv,
)

H = W = 4
FRAME_TOKENS = 4


def _installed(**kwargs):
    model = tiny_vace(**kwargs)
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _control(frames, batch=2, seed=5):
    return torch.randn(batch, VACE_CHANNELS, frames, H, W, generator=torch.Generator().manual_seed(seed))


def test_stock_parity_and_uninstall():
    model = tiny_vace()
    text, _ = conditioning(model)
    x, t = torch.randn(2, 16, 3, H, W), torch.tensor([700.0, 300.0])
    extra = {"control_hidden_states": _control(3), "control_hidden_states_scale": torch.tensor([0.5, 2.0])}
    stock = forward(model, x, t, text, extra=extra)
    model.set_attn_processor(CausalWanAttnProcessor())
    assert torch.equal(forward(model, x, t, text, extra=extra), stock)
    forward(model, x, t, text, extra=extra, store_kv=True)  # installs hooks, fills both branches
    assert torch.equal(forward(model, x, t, text, extra=extra), stock)
    uninstall_causal_kv(model)
    assert torch.equal(forward(model, x, t, text, extra=extra), stock)


def test_both_branches_created_with_local_block_indices():
    model = _installed()
    mine = KVCacheEngine()
    model.kv_cache_engines = {"vace": mine}
    with CausalContext(model) as ctx:
        pass
    engines = model.kv_cache_engines
    assert set(engines) == {"main", "vace"} and engines["vace"] is mine
    main, vace = engines["main"], engines["vace"]
    assert main.num_blocks == 3 and vace.num_blocks == 2
    for i, block in enumerate(model.vace_blocks):
        assert vace.block_index(block.attn1) == i and vace.block_index(block.attn2) == i
        assert not main.owns(block.attn1) and ctx.resolve_registered_engine(block.attn2) is vace
    for block in model.blocks:
        assert not vace.owns(block.attn1) and ctx.resolve_registered_engine(block.attn1) is main


@pytest.mark.parametrize("chunks", [[1, 1, 1], [2, 1, 2]], ids=["chunk1", "uneven"])
def test_rollout_matches_block_causal_full_forward(chunks):
    model = _installed()
    g = torch.Generator().manual_seed(0)
    tags = ("pos", "neg")
    cond = {tag: conditioning(model, seed=20 + i)[0] for i, tag in enumerate(tags)}
    control = _control(sum(chunks))
    scale = torch.tensor([0.7, 1.3])
    t = torch.tensor([600.0, 400.0])  # one timestep for the whole sequence, commits included
    committed = {tag: [] for tag in tags}
    for k, size in enumerate(chunks):
        start = sum(chunks[:k])
        for store_kv in (False, False, True):
            for tag in tags:
                x = torch.randn(2, 16, size, H, W, generator=g)
                extra = {"control_hidden_states": control[:, :, start:start + size],
                         "control_hidden_states_scale": scale}
                out = forward(model, x, t, cond[tag], extra=extra, start_frame=start, cache_tag=tag,
                              store_kv=store_kv)
                full_extra = {"control_hidden_states": control[:, :, :start + size],
                              "control_hidden_states_scale": scale}
                with torch.no_grad():
                    ref = masked_full_forward(model, torch.cat(committed[tag] + [x], dim=2), t, cond[tag], None,
                                              block_causal_mask(chunks[:k + 1], FRAME_TOKENS), **full_extra)
                err = (out - ref[:, :, start:]).abs().max().item()
                assert err < 1e-5, f"chunk {k} tag {tag} store_kv={store_kv}: max error {err:.2e}"
                if store_kv:
                    committed[tag].append(x)
    for engine in model.kv_cache_engines.values():
        assert engine.num_frames("pos") == engine.num_frames("neg") == sum(chunks)


def test_branch_isolation():
    model = _installed()
    text, _ = conditioning(model)
    x, t = torch.randn(2, 16, 1, H, W), torch.zeros(2)
    extra = {"control_hidden_states": _control(1)}
    forward(model, x, t, text, extra=extra, store_kv=True)
    main, vace = model.kv_cache_engines["main"], model.kv_cache_engines["vace"]
    main_before = cache_snapshot(model)["main"]
    # Only the vace engine changes when it is cropped, cleared or written.
    vace.crop(0)
    vace.clear()
    after = cache_snapshot(model)["main"]
    assert main_before[0] == after[0] and main_before[1] == after[1]
    assert all(torch.equal(a, b) for a, b in zip(main_before[2], after[2]))
    assert vace.num_frames("pos") == 0 and main.num_frames("pos") == 1
    # Block indices are local: vace block 1's K/V is not main block 1's.
    clear_caches(model)
    forward(model, x, t, text, extra=extra, store_kv=True)
    assert not torch.equal(vace.get_self_prefix(1, "pos")[0], main.get_self_prefix(1, "pos")[0])
    assert vace.memory_bytes() > 0 and main.memory_bytes() > vace.memory_bytes()  # 3 main blocks, 2 vace
    clear_caches(model)
    assert main.num_frames("pos") == vace.num_frames("pos") == 0
    assert not main.is_cross_init("pos") and not vace.is_cross_init("pos")


def test_shared_engine_rejected():
    model = _installed()
    shared = KVCacheEngine()
    with pytest.raises(ValueError, match="each branch needs its own engine instance"):
        CausalContext(model, cache_engines={"main": shared, "vace": shared}).__enter__()
    model.kv_cache_engines = {"main": shared, "vace": shared}
    with pytest.raises(ValueError, match="each branch needs its own engine instance"), CausalContext(model):
        pass


@pytest.mark.parametrize("extra, match", [
    ({}, "pass control_hidden_states"),
    ({"control_hidden_states": _control(1)}, r"control_hidden_states has shape \(2, 24, 1, 4, 4\) but this chunk "
                                             r"needs \(2, 24, 2, 4, 4\)"),
    ({"control_hidden_states": _control(3)}, r"shape \(2, 24, 3, 4, 4\) but this chunk needs"),
    ({"control_hidden_states": _control(2), "control_hidden_states_scale": torch.ones(3)},
     r"control_hidden_states_scale has shape \(3,\) but the model has 2 VACE layers \[0, 2\]"),
])
def test_bad_control_inputs(extra, match):
    model = _installed()
    text, _ = conditioning(model)
    forward(model, torch.randn(2, 16, 1, H, W), torch.zeros(2), text,
            extra={"control_hidden_states": _control(1)}, store_kv=True)
    calls = []
    model.vace_patch_embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    model.patch_embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    before = cache_snapshot(model)
    with pytest.raises(ValueError, match=match):
        forward(model, torch.randn(2, 16, 2, H, W), torch.zeros(2), text, extra=extra, start_frame=1, store_kv=True)
    assert calls == []
    assert_same_snapshot(before, cache_snapshot(model))


def test_per_token_timesteps_rejected_for_vace():
    model = _installed()
    text, _ = conditioning(model)
    with pytest.raises(ValueError, match="one timestep per sample"):
        forward(model, torch.randn(2, 16, 1, H, W), torch.zeros(2, 4), text,
                extra={"control_hidden_states": _control(1)}, start_frame=0)


def test_vace_rollout_slices_control_and_runs_cfg():
    model = _installed()
    text, _ = conditioning(model, batch=1)
    negative, _ = conditioning(model, batch=1, seed=3)
    noise = torch.randn(1, 16, 3, H, W, generator=torch.Generator().manual_seed(0))
    control = _control(3, batch=1)
    scale = torch.tensor([1.0, 0.5])
    result = causal_rollout(model, noise, text, negative_prompt_embeds=negative, guidance_scale=3.0, chunk_frames=1,
                            timesteps=[1000, 500], control_latents=control, control_scale=scale,
                            generator=torch.Generator().manual_seed(1), progress=False, cfg_batch=False)
    # The same rollout by hand (a forward per tag, as cfg_batch=False runs it), chunk by chunk, with the control
    # sliced to each chunk.
    clear_caches(model)
    g = torch.Generator().manual_seed(1)
    from diffusers_causal_kv.session import shifted_sigmas

    sigmas = shifted_sigmas([1000, 500], 5.0).tolist()
    out = []
    for start in range(3):
        x = noise[:, :, start:start + 1]
        extra = {"control_hidden_states": control[:, :, start:start + 1], "control_hidden_states_scale": scale}
        for i, sigma in enumerate(sigmas):
            t = torch.full((1,), sigma * 1000)
            pos = forward(model, x, t, text, extra=extra, start_frame=start, cache_tag="pos")
            neg = forward(model, x, t, negative, extra=extra, start_frame=start, cache_tag="neg")
            x0 = x - sigma * (neg + 3.0 * (pos - neg))
            if i + 1 < len(sigmas):
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(x0.shape, generator=g)
        for tag, prompt in (("pos", text), ("neg", negative)):
            forward(model, x0, torch.zeros(1), prompt, extra=extra, start_frame=start, cache_tag=tag, store_kv=True)
        out.append(x0)
    assert torch.equal(result.latents, torch.cat(out, dim=2))
    with pytest.raises(ValueError, match="VACE transformer needs control_latents"):
        causal_rollout(model, noise, text, progress=False)
