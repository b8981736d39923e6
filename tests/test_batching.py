"""Cross-session batching (issue #30, part 1): serve.step_streams runs several streams' chunks as one batch; every
stream's latents equal the same stream run alone, on every engine, with and without guidance, at different positions,
after a fault in one stream, a prompt switch of one stream, and streams that end at different times."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from diffusers_causal_kv import (
    CausalConfig,
    CausalWanPipeline,
    KVCacheEngine,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
)
from diffusers_causal_kv.model import topology
from diffusers_causal_kv.serve import step_streams
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_vace, tiny_wan

H = W = 32
FRAMES = 21  # 6 latent frames, chunks of 2
TIMESTEPS = (1000, 600, 300)
ATOL = 1e-5

ENGINES = {
    "vanilla": lambda: KVCacheEngine(),
    "static": lambda: StaticKVCacheEngine(8),
    "rolling": lambda: RollingKVCacheEngine(4, 1, positions="relative"),
    "rolling-absolute": lambda: RollingKVCacheEngine(4, 1),
    "fp8": lambda: RollingKVCacheEngine(4, 1, positions="relative", kv_dtype=torch.float8_e4m3fn),
}


def _pipe(transformer=None) -> CausalWanPipeline:
    return CausalWanPipeline(**tiny_pipeline_components(transformer), causal_config=CausalConfig(
        chunk_frames=2, timesteps=TIMESTEPS, num_frames=FRAMES))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards on one thread: an OpenMP team on a busy machine costs far more than the work, in the caller's
    thread and the step's worker threads alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipe():
    return _pipe()


def _stream(pipe, seed, engine="rolling", guidance=1.0, prompt=None, **kwargs):
    engines = {branch: ENGINES[engine]() for branch in topology(pipe.transformer).branches}
    args = dict(prompt=prompt or f"prompt {seed}", negative_prompt="blurry", guidance_scale=guidance, height=H,
                width=W, max_sequence_length=16, num_frames=FRAMES, output_type="latent",
                generator=torch.Generator().manual_seed(seed), cache_engines=engines)
    return pipe.stream(**{**args, **kwargs})


@contextlib.contextmanager
def _batch_sizes(pipe):
    """The batch of every forward of the first block while the block runs."""
    seen = []
    handle = pipe.transformer.blocks[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    try:
        yield seen
    finally:
        handle.remove()


def _run_batched(streams, steps=None) -> list[list]:
    """Step every stream together until all are exhausted: each stream's outcomes in order."""
    made = [[] for _ in streams]
    for _ in range(steps) if steps else itertools.count():
        results = step_streams(streams)
        if all(r is None for r in results):
            break
        for out, result in zip(made, results):
            if result is not None:
                out.append(result)
    return made


def _latents(chunks) -> torch.Tensor:
    return torch.cat([c.latents for c in chunks], dim=2)


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= ATOL


@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_batched_rows_equal_separate_rows(pipe, engine, guidance):
    alone = [list(_stream(pipe, seed, engine, guidance)) for seed in range(3)]
    with _batch_sizes(pipe) as seen:
        batched = _run_batched([_stream(pipe, seed, engine, guidance) for seed in range(3)])
    tags = 2 if guidance != 1.0 else 1
    assert set(seen) == {3 * tags}  # every forward of the three streams ran as one (they start at one frame)
    for one, many in zip(alone, batched):
        assert [c.index for c in many] == [0, 1, 2]
        assert [c.latent_frames for c in many] == [c.latent_frames for c in one]
        _assert_close(_latents(many), _latents(one))


def test_guided_and_unguided_streams_share_forwards(pipe):
    guidance = (3.0, 1.0, 5.0)
    alone = [list(_stream(pipe, seed, guidance=g)) for seed, g in enumerate(guidance)]
    with _batch_sizes(pipe) as seen:
        batched = _run_batched([_stream(pipe, seed, guidance=g) for seed, g in enumerate(guidance)])
    assert set(seen) == {5}  # two rows of each guided stream and one of the other, in each forward
    for one, many in zip(alone, batched):
        _assert_close(_latents(many), _latents(one))


def test_the_callers_autocast_applies_to_every_stream(pipe):
    def first_chunks(batched):
        streams = [_stream(pipe, seed, num_frames=5) for seed in range(2)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            made = step_streams(streams) if batched else [next(stream) for stream in streams]
        return [chunk.latents for chunk in made]

    plain = [next(_stream(pipe, seed, num_frames=5)).latents for seed in range(2)]
    for alone, batched, fp32 in zip(first_chunks(False), first_chunks(True), plain):
        assert (alone - fp32).abs().max() > 1e-3  # bf16 matrix products: autocast applied
        assert (batched - alone).abs().max() < 0.1 * (alone - fp32).abs().max()


def test_unbatched_steps_are_next_of_each_stream(pipe):
    alone = [list(_stream(pipe, seed)) for seed in range(2)]
    streams = [_stream(pipe, seed) for seed in range(2)]
    made = [[], []]
    while True:
        results = step_streams(streams, batched=False)
        if all(r is None for r in results):
            break
        for out, result in zip(made, results):
            out.append(result)
    for one, other in zip(alone, made):
        assert torch.equal(_latents(one), _latents(other))  # the same calls, bit for bit


@pytest.mark.parametrize("engine, shared", [("rolling", True), ("rolling-absolute", False)])
def test_streams_at_different_positions(pipe, engine, shared):
    """A stream two chunks ahead: relative positions number every full window alike, so the two share forwards once
    both windows are full; absolute positions never line up. Either way each equals itself alone."""
    long = dict(num_frames=None)
    alone = [list(itertools.islice(_stream(pipe, seed, engine, **long), n)) for seed, n in ((0, 5), (1, 3))]
    ahead, late = _stream(pipe, 0, engine, **long), _stream(pipe, 1, engine, **long)
    first = [next(ahead), next(ahead)]
    with _batch_sizes(pipe) as seen:
        batched = _run_batched([ahead, late], steps=3)
    assert (2 in seen) == shared
    _assert_close(_latents(first + batched[0]), _latents(alone[0]))
    _assert_close(_latents(batched[1]), _latents(alone[1]))


def test_streams_of_other_shapes_run_beside_each_other(pipe):
    specs = [dict(), dict(height=48, width=48), dict(chunk_frames=3)]
    alone = [list(_stream(pipe, seed, **spec)) for seed, spec in enumerate(specs)]
    with _batch_sizes(pipe) as seen:
        batched = _run_batched([_stream(pipe, seed, **spec) for seed, spec in enumerate(specs)])
    assert set(seen) == {1}
    for one, many in zip(alone, batched):
        _assert_close(_latents(many), _latents(one))


def _arm_fault(engine, verb: str, after: int):
    """Make ``engine.<verb>`` raise from its call ``after`` on, while ``armed[0]``."""
    armed, calls, original = [True], itertools.count(), getattr(engine, verb)

    def faulty(*args, **kwargs):
        if next(calls) >= after and armed[0]:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    setattr(engine, verb, faulty)
    return armed


@pytest.mark.parametrize("verb, after", [("update", 11), ("prepare_commit", 1)])
def test_a_stream_failing_mid_step_leaves_the_others_unchanged_and_itself_retryable(pipe, verb, after):
    """update: the second denoising step of the second chunk raises in the second block (8 calls per chunk: 3 steps
    and a commit over 2 blocks), inside the batched forward; prepare_commit: the second chunk's commit."""
    alone = [list(_stream(pipe, seed)) for seed in range(3)]
    streams = [_stream(pipe, seed) for seed in range(3)]
    armed = _arm_fault(streams[1].session.engine, verb, after)
    made = _run_batched(streams, steps=1)
    results = step_streams(streams)
    assert isinstance(results[1], RuntimeError) and "injected fault" in str(results[1])
    assert streams[1].session.pending_frames == 2 and streams[1].session.index == 1  # the chunk stays pending
    for i in (0, 2):
        made[i].append(results[i])
    armed[0] = False
    for out, more in zip(made, _run_batched(streams)):
        out.extend(more)
    for one, many in zip(alone, made):
        assert [c.index for c in many] == [0, 1, 2]
        _assert_close(_latents(many), _latents(one))


def test_prompt_switch_of_one_row(pipe):
    def switched(stream):
        chunks = [next(stream)]
        stream.switch_prompt("a blue cube")
        return chunks + list(stream)

    alone = [list(_stream(pipe, 0)), switched(_stream(pipe, 1)), list(_stream(pipe, 2))]
    streams = [_stream(pipe, seed) for seed in range(3)]
    made = _run_batched(streams, steps=1)
    streams[1].switch_prompt("a blue cube")
    for out, more in zip(made, _run_batched(streams)):
        out.extend(more)
    for one, many in zip(alone, made):
        _assert_close(_latents(many), _latents(one))


def test_exhausted_and_closed_streams_give_none(pipe):
    short, long, closed = _stream(pipe, 0, num_frames=13), _stream(pipe, 1), _stream(pipe, 2)
    closed.close()
    results = [step_streams([short, long, closed]) for _ in range(4)]
    assert [[r is None for r in step] for step in results] == [
        [False, False, True], [False, False, True], [True, False, True], [True, True, True]]


def test_decoded_frames_equal_separate_streams(pipe):
    alone = [list(_stream(pipe, seed, output_type="np")) for seed in range(2)]
    batched = _run_batched([_stream(pipe, seed, output_type="np") for seed in range(2)])
    for one, many in zip(alone, batched):
        for a, b in zip(one, many):
            assert a.video_frames == b.video_frames
            assert abs(a.frames - b.frames).max() <= 1e-4  # decoded in worker threads (see the streaming guide)


@pytest.mark.parametrize("kind", ["i2v", "vace"])
def test_i2v_and_vace_rows(kind):
    import numpy as np
    import PIL.Image

    rng = np.random.default_rng(0)
    frames = [PIL.Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)) for _ in range(FRAMES)]
    pipe = _pipe(tiny_wan(i2v=True) if kind == "i2v" else tiny_vace(vace_in_channels=96))

    def extra():
        if kind == "i2v":
            return dict(image=frames[0], image_embeds=torch.ones(1, 4, 8), max_sequence_length=512)
        return dict(control_video=iter(frames))

    alone = [list(_stream(pipe, seed, **extra())) for seed in range(2)]
    with _batch_sizes(pipe) as seen:
        batched = _run_batched([_stream(pipe, seed, **extra()) for seed in range(2)])
    assert set(seen) == {2}
    for one, many in zip(alone, batched):
        _assert_close(_latents(many), _latents(one))


def test_refuses_streams_it_cannot_step_together(pipe):
    stream = _stream(pipe, 0)
    with pytest.raises(ValueError, match="the same stream twice"):
        step_streams([stream, stream])
    shared = {b: RollingKVCacheEngine(4, 1, positions="relative") for b in topology(pipe.transformer).branches}
    with pytest.raises(ValueError, match="engines of its own"):
        step_streams([_stream(pipe, 1, cache_engines=shared), _stream(pipe, 2, cache_engines=shared)])
    with pytest.raises(TypeError, match="CausalWanPipeline.stream"):
        step_streams([iter([])])
    assert stream.session.index == 0  # nothing ran
