"""Guidance in one forward: a chunk's "pos" and "neg" passes as one batch of two tags
(``CausalContext(cache_tag=("pos", "neg"))``; the rollout planner's default with guidance on one device).

Each half of the batch reads and commits its own tag, so the batched forward must equal the two separate forwards
(fp32, atol 1e-5), outputs and everything the engines hold afterwards, on every engine, through commits and a rolling
eviction; the reference is the same engine kind driven by separate forwards.
"""

from __future__ import annotations

import pytest
import torch
from helpers import conditioning, forward, tiny_wan

from diffusers_causal_kv import (
    CausalWanAttnProcessor,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
    causal_rollout,
)

ATOL = 1e-5
BATCH = 2  # rows per tag
CHUNKS = [1, 2, 1, 2]  # the rolling windows (3 frames, 1 sink) evict from the third chunk on
ENGINES = {
    "vanilla": lambda: VanillaKVCacheEngine(),
    "static": lambda: StaticKVCacheEngine(max_frames=8),
    "rolling": lambda: RollingKVCacheEngine(3, sink_frames=1),
    "rolling-relative": lambda: RollingKVCacheEngine(3, sink_frames=1, positions="relative"),
    "vanilla-fp8": lambda: VanillaKVCacheEngine(kv_dtype=torch.float8_e4m3fn),
}


def _model(**config):
    model = tiny_wan(**config)
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _assert_same_engines(batched, separate):
    assert batched.tags() == separate.tags() and batched.memory_bytes() == separate.memory_bytes()
    for tag in separate.tags():
        assert batched.next_frame(tag) == separate.next_frame(tag)
        if isinstance(separate, RollingKVCacheEngine):
            assert batched.held_frames(tag) == separate.held_frames(tag)
        # fp8 storage: K/V that differ in the last fp32 bit (a batched matmul) round to neighbouring e4m3 codes when
        # they sit on a rounding boundary, one step (2**-3 of the value's binade) apart; measured on a CPU: 1 of 768.
        rtol = 2.0 ** -3 if batched.kv_dtype is not None else 0.0
        for block in range(separate.num_blocks):
            for a, b in zip(batched.get_self_prefix(block, tag), separate.get_self_prefix(block, tag)):
                torch.testing.assert_close(a, b, rtol=rtol, atol=ATOL)
            for a, b in zip(batched.read_cross(block, tag).tensors(), separate.read_cross(block, tag).tensors()):
                torch.testing.assert_close(a, b, rtol=rtol, atol=ATOL)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_one_forward_of_two_tags_equals_two_forwards(name):
    """Denoising passes and commits on both tags, with other latents and prompts per tag (a swap of the halves
    would show): every output and, after each commit, every engine's state equal the separate forwards'."""
    model = _model()
    prompts = [conditioning(model, batch=BATCH, seed=seed)[0] for seed in (1, 2)]
    batched, separate = ENGINES[name](), ENGINES[name]()
    g = torch.Generator().manual_seed(0)
    start = 0
    for size in CHUNKS:
        for t, store in ((700.0, False), (300.0, False), (0.0, True)):
            xs = [torch.randn(BATCH, 16, size, 4, 4, generator=g) for _ in prompts]
            each = [forward(model, x, torch.full((BATCH,), t), text, start_frame=start, cache_tag=tag, store_kv=store,
                            cache_engines={"main": separate}) for x, text, tag in zip(xs, prompts, ("pos", "neg"))]
            both = forward(model, torch.cat(xs), torch.full((2 * BATCH,), t), torch.cat(prompts), start_frame=start,
                           cache_tag=("pos", "neg"), store_kv=store, cache_engines={"main": batched})
            torch.testing.assert_close(both, torch.cat(each), rtol=0, atol=ATOL, msg=f"chunk at {start}, t={t}")
        _assert_same_engines(batched, separate)
        start += size
    if name.startswith("rolling"):
        assert separate.held_frames("pos") == [range(0, 1), range(5, 6)]  # frames 1..4 evicted


def test_a_batch_of_tags_continues_tags_filled_separately_and_vice_versa():
    """The batched pass keys each tag by its own rows' prompt: a tag filled by separate forwards accepts it."""
    model = _model()
    prompts = [conditioning(model, batch=1, seed=seed)[0] for seed in (1, 2)]
    engine, reference = VanillaKVCacheEngine(), VanillaKVCacheEngine()
    x = torch.randn(1, 16, 1, 4, 4)
    for start, batched in ((0, False), (1, True), (2, False)):
        for tag, text in zip(("pos", "neg"), prompts):
            forward(model, x, torch.zeros(1), text, start_frame=start, cache_tag=tag, store_kv=True,
                    cache_engines={"main": reference})
        if batched:
            forward(model, torch.cat([x, x]), torch.zeros(2), torch.cat(prompts), start_frame=start,
                    cache_tag=("pos", "neg"), store_kv=True, cache_engines={"main": engine})
        else:
            for tag, text in zip(("pos", "neg"), prompts):
                forward(model, x, torch.zeros(1), text, start_frame=start, cache_tag=tag, store_kv=True,
                        cache_engines={"main": engine})
    _assert_same_engines(engine, reference)


def test_a_batched_pass_refused_for_one_tag_changes_neither():
    """Every tag's pass is checked before any work: a batch whose second tag cannot continue commits nothing, and
    a fault inside the forward commits neither tag either."""
    model = _model()
    text, _ = conditioning(model, batch=1)
    engine = StaticKVCacheEngine(max_frames=4)
    x = torch.randn(2, 16, 2, 4, 4)
    forward(model, x[:1], torch.zeros(1), text, start_frame=0, cache_tag="pos", store_kv=True,
            cache_engines={"main": engine})
    with pytest.raises(ValueError, match="start_frame"):  # "neg" holds nothing: it must start at 0
        forward(model, x, torch.zeros(2), torch.cat([text, text]), start_frame=2, cache_tag=("pos", "neg"),
                store_kv=True, cache_engines={"main": engine})
    assert engine.tags() == ["pos"] and engine.num_frames("pos") == 2
    forward(model, x[:1], torch.zeros(1), text, start_frame=0, cache_tag="neg", store_kv=True,
            cache_engines={"main": engine})
    handle = model.blocks[1].ffn.register_forward_pre_hook(lambda module, args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        forward(model, x, torch.zeros(2), torch.cat([text, text]), start_frame=2, cache_tag=("pos", "neg"),
                store_kv=True, cache_engines={"main": engine})
    handle.remove()
    assert engine.num_frames("pos") == engine.num_frames("neg") == 2


def _counting(model):
    batches = []
    model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(kwargs["hidden_states"].shape[0]),
                                    with_kwargs=True)
    return batches


@pytest.mark.parametrize("name", ["vanilla", "static", "rolling"])
def test_rollout_with_batched_guidance_equals_two_forwards(name):
    """causal_rollout with guidance: cfg_batch (the default) runs one forward of both tags per step and per commit,
    and gives the latents and caches of cfg_batch=False."""
    model = _model()
    text, _ = conditioning(model, batch=1, seed=1)
    negative, _ = conditioning(model, batch=1, seed=2)
    noise = torch.randn(1, 16, sum(CHUNKS), 4, 4, generator=torch.Generator().manual_seed(3))
    batches = _counting(model)
    results = {}
    for cfg_batch in (True, False):
        engine = ENGINES[name]()
        batches.clear()
        out = causal_rollout(model, noise, text, negative_prompt_embeds=negative, guidance_scale=3.0,
                             chunk_frames=CHUNKS, timesteps=(1000, 500), cache_engines={"main": engine},
                             generator=torch.Generator().manual_seed(4), progress=False, cfg_batch=cfg_batch)
        results[cfg_batch] = (out.latents, engine, list(batches))
    (latents, engine, batched), (ref_latents, ref_engine, separate) = results[True], results[False]
    torch.testing.assert_close(latents, ref_latents, rtol=0, atol=ATOL)
    _assert_same_engines(engine, ref_engine)
    steps = len(CHUNKS) * 3  # two denoising forwards and a commit per chunk
    assert batched == [2] * steps and separate == [1] * 2 * steps


def test_prompts_of_different_shapes_run_as_two_forwards():
    model = _model()
    text, _ = conditioning(model, batch=1, seed=1)
    negative, _ = conditioning(model, batch=1, seed=2, text_len=6)
    batches = _counting(model)
    causal_rollout(model, torch.randn(1, 16, 2, 4, 4), text, negative_prompt_embeds=negative, guidance_scale=3.0,
                   chunk_frames=1, timesteps=(1000,), progress=False)
    assert batches == [1] * 8
