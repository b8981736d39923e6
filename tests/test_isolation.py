"""Isolation: rollouts that share one transformer's weights, each with its own engines, give the results they
give alone, whether run in threads, in interleaved asyncio tasks, or with gradient checkpointing."""

import asyncio
import threading

import torch
from helpers import tiny_wan

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, KVCacheEngine, causal_rollout


def _model(**config):
    model = tiny_wan(**config)
    model.set_attn_processor(CausalWanAttnProcessor())
    return model


def _session(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, 6, 4, 4, generator=g), torch.randn(1, 12, 32, generator=g)


def _rollout(model, noise, text, seed):
    return causal_rollout(model, noise, text, chunk_frames=2, timesteps=[1000, 500], progress=False,
                          cache_engines={"main": KVCacheEngine()},
                          generator=torch.Generator().manual_seed(seed)).latents


def _run_in_threads(*jobs):
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def worker(i, job):
        try:
            barrier.wait()
            results[i] = job()
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_two_threads_equal_two_rollouts_one_after_the_other():
    model = _model()
    sessions = [_session(seed) for seed in (1, 2)]
    alone = [_rollout(model, noise, text, i) for i, (noise, text) in enumerate(sessions)]
    together = _run_in_threads(*(lambda i=i, s=s: _rollout(model, *s, i) for i, s in enumerate(sessions)))
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


def test_interleaved_asyncio_tasks_equal_sequential_rollouts():
    model = _model()
    sessions = [_session(seed) for seed in (3, 4)]

    async def rollout(noise, text):
        engines = {"main": KVCacheEngine()}
        out = []
        for start in range(0, 6, 2):
            x = noise[:, :, start:start + 2]
            # Grad mode is per thread, not per task: keep awaits outside no_grad(), inside the contexts.
            with CausalContext(model, start_frame=start, cache_engines=engines):
                await asyncio.sleep(0)  # the other task runs its forwards while this context is open
                with torch.no_grad():
                    flow = model(hidden_states=x, timestep=torch.full((1,), 1000.0), encoder_hidden_states=text,
                                 return_dict=False)[0]
            clean = x - flow
            with CausalContext(model, start_frame=start, store_kv=True, cache_engines=engines):
                await asyncio.sleep(0)
                with torch.no_grad():
                    model(hidden_states=clean, timestep=torch.zeros(1), encoder_hidden_states=text)
            out.append(clean)
        return torch.cat(out, dim=2)

    async def both():
        return await asyncio.gather(*(rollout(*s) for s in sessions))

    alone = [asyncio.run(rollout(*s)) for s in sessions]
    for a, b in zip(alone, asyncio.run(both())):
        assert torch.equal(a, b)


def test_concurrent_checkpointed_training_forwards_keep_their_own_pass():
    model = _model(layers=3).train()
    model.enable_gradient_checkpointing()
    sessions = [_session(seed) for seed in (5, 6)]

    def step(noise, text, prefix_frames):
        engines = {"main": KVCacheEngine()}
        with torch.no_grad():
            for start in range(prefix_frames):
                with CausalContext(model, start_frame=start, store_kv=True, cache_engines=engines):
                    model(hidden_states=noise[:, :, start:start + 1], timestep=torch.zeros(1),
                          encoder_hidden_states=text)
        x = noise[:, :, prefix_frames:prefix_frames + 1].clone().requires_grad_()
        with CausalContext(model, start_frame=prefix_frames, cache_engines=engines):
            out = model(hidden_states=x, timestep=torch.full((1,), 500.0), encoder_hidden_states=text,
                        return_dict=False)[0]
        return torch.autograd.grad(out.square().sum(), x)[0]

    jobs = [lambda s=s, n=n: step(*s, n) for s, n in zip(sessions, (1, 3))]
    alone = [job() for job in jobs]
    for a, b in zip(alone, _run_in_threads(*jobs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Outside any context the checkpointing function is the stock one again.
    x = torch.randn(1, 16, 2, 4, 4, requires_grad=True)
    out = model(hidden_states=x, timestep=torch.zeros(1), encoder_hidden_states=sessions[0][1], return_dict=False)[0]
    out.sum().backward()
    assert x.grad is not None
