"""torch.compile over the transformer blocks (diffusers' compile_repeated_blocks): with the static engine a cached
rollout matches eager, with no graph break and a number of compiled graphs that does not grow with the chunks; with a
rolling engine whose window is full, nothing recompiles from chunk to chunk (the steady state that CUDA graphs,
mode="reduce-overhead", capture on a GPU)."""

import pytest
import torch
from helpers import conditioning, tiny_wan
from torch._dynamo.utils import counters

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, RollingKVCacheEngine, StaticKVCacheEngine

# aot_eager traces through AOTAutograd (functionalised in-place buffer writes) without a C++ toolchain run per graph;
# benchmarks/rollout.py --compile exercises inductor.
BACKEND = "aot_eager"


def _rollout(model, engines, chunks, text, seed=0):
    g = torch.Generator().manual_seed(seed)
    outputs, start = [], 0
    for size in chunks:
        x = torch.randn(2, 16, size, 4, 4, generator=g)
        for t in (900.0, 500.0):
            with torch.no_grad(), CausalContext(model, start_frame=start, cache_engines=engines):
                x = model(hidden_states=x, timestep=torch.full((2,), t), encoder_hidden_states=text,
                          return_dict=False)[0]
        with torch.no_grad(), CausalContext(model, start_frame=start, store_kv=True, cache_engines=engines):
            model(hidden_states=x, timestep=torch.zeros(2), encoder_hidden_states=text, return_dict=False)
        outputs.append(x)
        start += size
    for engine in engines.values():
        engine.clear()
    return torch.cat(outputs, dim=2)


@pytest.mark.slow
@torch._dynamo.config.patch(recompile_limit=64)  # graphs are specialised per block (see the bound below)
def test_compiled_blocks_match_eager_without_graph_breaks():
    model = tiny_wan(layers=2)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    engines = {"main": StaticKVCacheEngine(max_frames=12)}
    chunks = [2, 2, 2]
    eager = _rollout(model, engines, chunks, text)

    torch._dynamo.reset()
    counters.clear()
    model.compile_repeated_blocks(backend=BACKEND, fullgraph=True)  # fullgraph: a graph break would raise
    compiled = _rollout(model, engines, chunks, text)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)
    assert not counters["graph_break"]
    graphs = counters["stats"]["unique_graphs"]
    # Graphs depend on the block and the kind of pass (a tag's first chunk or a later one, denoise or commit, the
    # first dynamic-shape recompile), never on the chunk index: a longer rollout compiles nothing new.
    print(f"{graphs} graphs for {len(model.blocks)} blocks")
    assert graphs <= 6 * len(model.blocks)
    longer = _rollout(model, engines, chunks + [2, 2], text)
    assert counters["stats"]["unique_graphs"] == graphs
    torch.testing.assert_close(longer[:, :, :6], eager, rtol=0, atol=1e-4)


def test_uncompiled_processor_sees_no_mirrored_pass_outside_forwards():
    from diffusers_causal_kv.ambient import _COMPILED_PASS

    model = tiny_wan()
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    with torch.no_grad(), CausalContext(model):
        model(hidden_states=torch.randn(2, 16, 1, 4, 4), timestep=torch.zeros(2), encoder_hidden_states=text)
        assert getattr(_COMPILED_PASS, "value", None) is None  # published only while a forward runs


def _graphs_per_chunk(model, engines, text, chunks):
    """Run ``chunks`` (a rollout continuing the engines' cache) and record the number of compiled graphs after each."""
    g = torch.Generator().manual_seed(1)
    outputs, graphs, start = [], [], 0
    for size in chunks:
        x = torch.randn(2, 16, size, 4, 4, generator=g)
        with torch.no_grad(), CausalContext(model, start_frame=start, cache_engines=engines):
            x = model(hidden_states=x, timestep=torch.full((2,), 500.0), encoder_hidden_states=text,
                      return_dict=False)[0]
        with torch.no_grad(), CausalContext(model, start_frame=start, store_kv=True, cache_engines=engines):
            model(hidden_states=x, timestep=torch.zeros(2), encoder_hidden_states=text, return_dict=False)
        outputs.append(x)
        graphs.append(counters["stats"]["unique_graphs"])
        start += size
    return torch.cat(outputs, dim=2), graphs


@pytest.mark.parametrize("positions", ["absolute", "relative"])
@pytest.mark.parametrize("window, chunks, full", [
    (3, [1] * 7, 3),  # a sink of 1 and one ring slot, written every chunk: full from the third chunk on
    (5, [1] * 10, 4),  # three ring slots: the window starts at three different slots in turn (three phases)
])
@torch._dynamo.config.patch(recompile_limit=64)
def test_rolling_steady_state_compiles_once(positions, window, chunks, full):
    """Once a rolling window is full every chunk has the same shapes (the attended window, the ring slot a commit
    writes) whatever the ring's phase: compiled blocks (aot_eager here; reduce-overhead on CUDA) give eager's
    results and compile nothing new from chunk to chunk."""
    model = tiny_wan(layers=1, rope_max_seq_len=64)
    model.set_attn_processor(CausalWanAttnProcessor())
    text, _ = conditioning(model)
    engines = {"main": RollingKVCacheEngine(window, sink_frames=1, positions=positions)}
    eager, _ = _graphs_per_chunk(model, engines, text, chunks)
    engines["main"].clear()
    torch._dynamo.reset()
    counters.clear()
    model.compile_repeated_blocks(backend=BACKEND, fullgraph=True)
    try:
        compiled, graphs = _graphs_per_chunk(model, engines, text, chunks)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    assert not counters["graph_break"]
    print(f"graphs after each chunk: {graphs}")
    assert len(set(graphs[full:])) == 1, graphs
