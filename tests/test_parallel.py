"""Causal rollouts on several ranks: diffusers' context parallelism under ``causal_cp_plan`` and guidance across
ranks (``CFGAcrossRanks``), each equal to the same rollout on one device (fp32, atol 1e-5).

Every check runs in one ``torch.multiprocessing.spawn`` of two CPU processes joined by gloo (one spawn per test, a
few seconds each). Each worker builds its single-device reference itself from the same seeds, so nothing crosses
process boundaries but the collectives under test.

Test-only shim: on a CPU-only torch build ``torch.accelerator.device_count()`` is 0, and diffusers'
``enable_parallelism`` computes ``rank % device_count()``; the workers report one device (:func:`_worker`). The
package itself does not patch anything.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import ContextParallelConfig
from helpers import VACE_CHANNELS, assert_same_snapshot, cache_snapshot, tiny_vace, tiny_wan

from diffusers_causal_kv import (
    CausalContext,
    CausalWanAttnProcessor,
    CFGAcrossRanks,
    RollingKVCacheEngine,
    RolloutPlanner,
    causal_cp_plan,
    causal_rollout,
)
from diffusers_causal_kv.testing import tiny_conditioning

CHUNKS = [3, 2, 3]  # a flat split of 3 frames x 8 tokens over 2 ranks would cut the second frame in half
FRAMES, HEIGHT, WIDTH = sum(CHUNKS), 8, 4  # post-patch grid 4 x 2: each rank holds 2 rows of every frame
TIMESTEPS = (1000, 500)
ATOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, store: str, checks) -> None:
    torch.accelerator.device_count = lambda: 1  # the test-only shim of the module docstring
    torch.set_num_threads(1)
    # A file store rather than tcp://: with tcp, rank 0 hosts the store and may exit while a peer still tears down.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for check in checks:
            check(rank)
        dist.barrier()  # no rank closes its connections while a peer may still be using them
    finally:
        dist.destroy_process_group()
    # Every check passed: leave without the interpreter's teardown, where a worker was once seen aborting (SIGABRT,
    # "terminate called without an active exception", from a native thread) after its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(*checks, world: int = 2) -> None:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(world, os.path.join(folder, "store"), checks), nprocs=world, join=True)


# ---------------------------------------------------------------------------------------------- builders
def _installed(model, engines=None):
    if engines is not None:
        model.kv_cache_engines = engines
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _parallel(model):
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2), cp_plan=causal_cp_plan(model))
    return model


def _inputs(model, frames=FRAMES, control=False):
    text, _ = tiny_conditioning(model, batch=1, seed=1)
    negative, _ = tiny_conditioning(model, batch=1, seed=2)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(1, 16, frames, HEIGHT, WIDTH, generator=g)
    extra = {"control_latents": torch.randn(1, VACE_CHANNELS, frames, HEIGHT, WIDTH, generator=g)} if control else {}
    return noise, text, negative, extra


def _rollout(model, guidance_scale=3.0, control=False, **kwargs):
    noise, text, negative, extra = _inputs(model, control=control)
    return causal_rollout(model, noise, text, negative_prompt_embeds=negative, guidance_scale=guidance_scale,
                          chunk_frames=CHUNKS, timesteps=TIMESTEPS, progress=False,
                          generator=torch.Generator().manual_seed(4), **extra, **kwargs).latents


def _bytes(model) -> tuple[int, int]:
    """(self-attention bytes, cross-attention bytes) over every engine of ``model``."""
    self_bytes = cross_bytes = 0
    for engine in model.kv_cache_engines.values():
        self_bytes += sum(engine._entry_bytes(e) for tags in engine._self_kv.values() for e in tags.values())
        cross_bytes += sum(t.nbytes for tags in engine._cross_kv.values() for e in tags.values() for t in e.tensors())
    return self_bytes, cross_bytes


def _assert_sharded_like(parallel, single) -> None:
    (self_p, cross_p), (self_s, cross_s) = _bytes(parallel), _bytes(single)
    assert self_p * 2 == self_s and cross_p == cross_s, ((self_p, cross_p), (self_s, cross_s))
    for branch, engine in parallel.kv_cache_engines.items():
        reference = single.kv_cache_engines[branch]
        frames = {t: engine.num_frames(t) for t in engine.tags()}
        assert frames == {t: reference.num_frames(t) for t in reference.tags()}


def _assert_close(a, b) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=0), (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------- the checks
def check_t2v_with_guidance(rank):
    """Parallelism enabled after installing the processors, before the first context."""
    single = _installed(tiny_wan(layers=2))
    parallel = _parallel(_installed(tiny_wan(layers=2)))
    _assert_close(_rollout(parallel), _rollout(single))
    _assert_sharded_like(parallel, single)


def check_vace_enabled_before_install(rank):
    """VACE control latents split like the hidden states; parallelism enabled before the processors exist."""
    single = _installed(tiny_vace())
    parallel = _installed(_parallel(tiny_vace()))
    _assert_close(_rollout(parallel, control=True), _rollout(single, control=True))
    _assert_sharded_like(parallel, single)


def check_rolling_enabled_after_first_context(rank):
    """A rolling window that evicts (4 frames, chunks of 3, 2, 3); parallelism enabled after a first rollout."""
    def rolling():
        return {"main": RollingKVCacheEngine(window_frames=4, sink_frames=1)}

    single = _installed(tiny_wan(layers=2), rolling())
    parallel = _installed(tiny_wan(layers=2), rolling())
    _rollout(parallel, guidance_scale=1.0)  # the plugin's hooks are installed before diffusers' split and gather
    _parallel(parallel)
    _assert_close(_rollout(parallel), _rollout(single))
    _assert_sharded_like(parallel, single)
    held = parallel.kv_cache_engines["main"].held_frames("pos")
    assert held == single.kv_cache_engines["main"].held_frames("pos") and sum(map(len, held)) < FRAMES  # evicted


def check_plain_forward_under_the_plan(rank):
    """Outside a context the processors compute the stock attention, on the rank's rows, with their positions."""
    single = tiny_wan(layers=2)
    parallel = _parallel(_installed(tiny_wan(layers=2)))
    noise, text, _, _ = _inputs(single, frames=2)
    t = torch.full((1,), 500.0)
    with torch.no_grad():
        expected = single(hidden_states=noise, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        got = parallel(hidden_states=noise, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    _assert_close(got, expected)


def check_failed_commit_changes_no_rank(rank):
    """A failure on rank 1 while preparing a commit leaves both ranks' caches as they were."""
    model = _parallel(_installed(tiny_wan(layers=2)))
    _rollout(model)
    noise, text, negative, _ = _inputs(model, frames=2)
    planner = RolloutPlanner(model, text, negative_prompt_embeds=negative, guidance_scale=3.0)
    chunk = planner.plan(noise, 2, first_frame=FRAMES)[0]
    before = cache_snapshot(model)
    engine = model.kv_cache_engines["main"]
    if rank == 1:
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("injected on rank 1")
        engine.prepare_commit = out_of_memory
    expected = "injected on rank 1" if rank == 1 else "commit refused on every rank"
    with pytest.raises((torch.OutOfMemoryError, RuntimeError), match=expected):
        planner.commit(noise, chunk)
    assert_same_snapshot(before, cache_snapshot(model))
    engine.__dict__.pop("prepare_commit", None)  # both ranks commit the chunk once the cause is gone
    planner.commit(noise, chunk)
    assert engine.num_frames("pos") == FRAMES + 2


def check_guidance_across_ranks(rank):
    single = _installed(tiny_wan(layers=2))
    split = _installed(tiny_wan(layers=2))
    with CFGAcrossRanks():
        got = _rollout(split)
    _assert_close(got, _rollout(single))
    engine = split.kv_cache_engines["main"]
    assert engine.tags() == (["neg"] if rank == 1 else ["pos"])
    (self_split, cross_split), (self_single, cross_single) = _bytes(split), _bytes(single)
    assert self_split * 2 == self_single and cross_split * 2 == cross_single


def check_refusals(rank):
    """diffusers' own Wan plan and ring attention are refused before any work."""
    own = _installed(tiny_wan(layers=2))
    own.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    with pytest.raises(ValueError, match="is not causal_cp_plan"), CausalContext(own, start_frame=0):
        pass
    ring = _installed(tiny_wan(layers=2))
    ring.enable_parallelism(config=ContextParallelConfig(ring_degree=2), cp_plan=causal_cp_plan(ring))
    with pytest.raises(NotImplementedError, match="ring attention"), CausalContext(ring, start_frame=0):
        pass
    assert not hasattr(own, "kv_cache_engines") and not hasattr(ring, "kv_cache_engines")  # refused before any work


# ---------------------------------------------------------------------------------------------- the tests
def test_context_parallel_rollouts_equal_one_rank():
    _spawn(check_t2v_with_guidance, check_vace_enabled_before_install, check_rolling_enabled_after_first_context,
           check_plain_forward_under_the_plan)


def test_commits_agree_across_ranks():
    _spawn(check_failed_commit_changes_no_rank, check_refusals)


def test_guidance_across_ranks_equals_one_device():
    _spawn(check_guidance_across_ranks)


def check_guidance_across_ranks_with_context_parallelism(rank):
    """A 2-D mesh of 4 ranks: guidance tag x rows of the sequence."""
    mesh = dist.device_mesh.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("cfg", "ring", "ulysses"))
    single = _installed(tiny_wan(layers=2))
    model = _installed(tiny_wan(layers=2))
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2, mesh=mesh["ring", "ulysses"]),
                             cp_plan=causal_cp_plan(model))
    with CFGAcrossRanks(mesh["cfg"].get_group(), commit_group=dist.group.WORLD):
        got = _rollout(model)
    _assert_close(got, _rollout(single))
    assert model.kv_cache_engines["main"].tags() == (["neg"] if mesh["cfg"].get_local_rank() == 1 else ["pos"])
    (self_mesh, cross_mesh), (self_single, cross_single) = _bytes(model), _bytes(single)
    assert self_mesh * 4 == self_single and cross_mesh * 2 == cross_single


def test_guidance_across_ranks_with_context_parallelism_on_a_2d_mesh():
    _spawn(check_guidance_across_ranks_with_context_parallelism, world=4)


def check_ranks_holding_other_inputs_are_refused(rank):
    """#26 case 6: a script seeding by rank (or giving each rank another prompt) is refused on every rank, naming
    the rank and the input that differs, before any cache is cleared (it used to run: the ranks' latents apart, and
    neither a one-device rollout of either seed)."""
    for cfg in (False, True):
        model = _installed(tiny_wan(layers=2))
        if not cfg:
            _parallel(model)
        across = CFGAcrossRanks if cfg else contextlib.nullcontext
        with across():
            _rollout(model)  # the same inputs on every rank: accepted
        before = cache_snapshot(model)
        noise, text, negative, _ = _inputs(model)
        other_text, _ = tiny_conditioning(model, batch=1, seed=10 + rank)
        for prompt, generator, differs in (
                (text, torch.Generator().manual_seed(rank), "random generator state (generator=)"),
                (other_text, torch.Generator().manual_seed(4), "prompt_embeds")):
            with across(), pytest.raises(ValueError, match="the ranks of a rollout must hold the same") as caught:
                causal_rollout(model, noise, prompt, negative_prompt_embeds=negative, guidance_scale=3.0,
                               chunk_frames=CHUNKS, timesteps=TIMESTEPS, progress=False, generator=generator)
            assert f"rank 1 differs from rank 0 in its {differs}." in str(caught.value), str(caught.value)
            assert_same_snapshot(before, cache_snapshot(model))


def test_ranks_holding_other_inputs_are_refused():
    _spawn(check_ranks_holding_other_inputs_are_refused)


# ---------------------------------------------------------------------------------------------- the torchrun example
def _example_worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    import importlib.util
    import pathlib

    torch.accelerator.device_count = lambda: 1  # the test-only shim of the module docstring
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "parallel_rollout.py"
    spec = importlib.util.spec_from_file_location("parallel_rollout", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(argv)


@pytest.mark.parametrize("argv", [["--cfg-parallel", "--guidance-scale", "3"], ["--stream"]],
                         ids=["pipeline-cfg-parallel", "stream-context-parallel"])
def test_torchrun_example(tmp_path, argv):
    output = tmp_path / "out.mp4"
    argv = [*argv, "--num-frames", "13", "--output", str(output)]
    mp.spawn(_example_worker, args=(2, _free_port(), argv), nprocs=2, join=True)
    assert output.stat().st_size > 0
