"""benchmarks/rollout.py runs at --size tiny and emits one valid JSON line with every CPU field (no timing
assertions: speed is the benchmark's business)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "rollout.py"
VARIANTS = {"cached-vanilla", "cached-static", "ideal", "no-cache"}
ENGINES = {"cached-vanilla", "cached-static"}


REALTIME_ROWS = {"eager", "compiled", "compiled+graphs", "fp8 cache", "cfg separate", "cfg batched"}
REALTIME_FIELDS = {
    "chunk_latency_seconds", "chunk_decode_seconds", "time_to_first_frame_seconds",
    "time_to_first_frame_with_decode_seconds", "video_frames_per_second", "video_frames_per_second_with_decode",
    "steady_video_frames_per_second", "steady_video_frames_per_second_with_decode", "steady_chunk_latency_seconds",
    "first_stream_seconds", "engine_memory_bytes", "compile", "graphs_compiled_first_stream",
    "recompiles_after_first_stream", "flops", "decode_flops", "flop_lower_bound_seconds",
    "flop_lower_bound_with_decode_seconds", "flop_bound_video_frames_per_second",
    "flop_bound_video_frames_per_second_with_decode", "reference", "max_abs_diff_vs_reference",
}
PYTHON_COST_FIELDS = {"layers", "forward_tokens", "rounds", "stock_us", "installed_no_context_us", "cached_us",
                      "ideal_us", "installed_no_context_vs_stock_ratio", "stock_copy_vs_stock_ratio", "context_cost_us"}


def _load_benchmark(monkeypatch):
    spec = importlib.util.spec_from_file_location("rollout_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # its dataclasses look their module up there
    spec.loader.exec_module(benchmark)
    return benchmark


@pytest.fixture(scope="module")
def tiny_run():
    """The CI smoke run: the tiny preset, and the GPU benchmark's real-time rows at their reduced shape."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--device", "cpu", "--repeats", "1",
                          "--realtime", "reduced"], capture_output=True, text=True, timeout=600, check=True)
    return run.stdout, json.loads(run.stdout.strip().splitlines()[-1])


def test_tiny_benchmark_emits_every_cpu_field(tiny_run):
    stdout, report = tiny_run
    assert report["preset"] == "tiny" and report["device"] == "cpu" and report["date"]
    assert set(report["seconds"]) == set(report["chunk_seconds"]) == VARIANTS
    assert all(len(c) == len(report["chunk_sizes"]) for c in report["chunk_seconds"].values())
    for field in ("nocache_vs_cached_wall_ratio", "engine_vs_ideal_ratio"):
        assert set(report[field]) == ENGINES and all(v > 0 for v in report[field].values())
    assert report["nocache_vs_cached_flop_ratio"] > 1
    assert report["installed_no_context_vs_stock_ratio"] > 0 and report["installed_no_context_bitwise_equal"]
    assert report["memory_bytes"] == report["memory_bytes_analytic"]
    assert report["memory_bytes_match"] == {name: True for name in ENGINES}
    assert report["peak_process_memory_bytes"] > 0
    assert all(diff < 1e-4 for diff in report["max_abs_diff_vs_static"].values())  # the variants agree
    assert "compile" not in report
    assert "no-cache / cached" in stdout  # the table precedes the JSON
    assert report["targets_judged"] is False and "not judged at --size tiny" in stdout
    assert "--size tiny is a smoke test" in stdout
    costs = report["python_costs"]
    assert set(costs) == PYTHON_COST_FIELDS and costs["rounds"] > 0
    assert all(costs[f] > 0 for f in ("stock_us", "installed_no_context_us", "cached_us", "ideal_us"))
    assert "python costs on a tiny model" in stdout


def test_gpu_preset_runs_reduced_on_cpu_with_every_field(tiny_run, monkeypatch):
    stdout, report = tiny_run
    realtime = report["realtime"]
    assert realtime["shape_name"] == "reduced" and realtime["compile_backend"] == "aot_eager"
    rows = realtime["rows"]
    assert set(rows) == REALTIME_ROWS
    chunks = len(realtime["chunk_sizes"])
    for name, row in rows.items():
        assert set(row) == REALTIME_FIELDS, name
        assert len(row["chunk_latency_seconds"]) == len(row["chunk_decode_seconds"]) == chunks
        assert row["time_to_first_frame_with_decode_seconds"] > row["time_to_first_frame_seconds"] > 0
        assert row["time_to_first_frame_seconds"] < row["chunk_latency_seconds"][0]  # before chunk 0's commit
        assert row["video_frames_per_second"] > row["video_frames_per_second_with_decode"] > 0
        # the FLOP bound is a bound: nothing runs faster than the device's measured matmul rate allows
        assert row["flop_bound_video_frames_per_second"] > row["video_frames_per_second"]
        assert row["flop_lower_bound_seconds"] < sum(row["chunk_latency_seconds"])
    assert realtime["steady_chunks"] == [2, 3, 4]  # window 6, chunks of 2: full from frame 4 on
    assert rows["compiled+graphs"]["compile"] == {"backend": "aot_eager", "cuda_graphs": False}  # graphs: CUDA only
    assert rows["compiled"]["graphs_compiled_first_stream"] > 0
    assert rows["compiled"]["recompiles_after_first_stream"] == 0  # a second stream compiles nothing new
    for name in ("compiled", "compiled+graphs"):
        assert rows[name]["max_abs_diff_vs_reference"] < 1e-5
    assert rows["cfg batched"]["reference"] == "cfg separate"
    assert rows["cfg batched"]["max_abs_diff_vs_reference"] < 1e-4
    # fp8 cache: a quarter of the fp32 entries plus one scale byte per token and head
    head_dim = realtime["shape"]["head_dim"]
    assert rows["fp8 cache"]["engine_memory_bytes"] * 4 * head_dim == rows["eager"]["engine_memory_bytes"] * (
        head_dim + 1)
    assert realtime["cfg_batched_vs_separate_ratio"] > 0 and "batched / separate CFG" in stdout
    assert realtime["frames_not_compiled"] == 0  # no recompile limit hit: the compiled rows ran compiled

    # The counted FLOPs (torch's FlopCounterMode) equal the analytic count of benchmarks/rollout.py for the same
    # stream: every denoising step and commit, attention over the rolling window, text K/V projected until cached.
    benchmark = _load_benchmark(monkeypatch)
    shape = realtime["shape"]
    preset = benchmark.Preset(**{k: shape[k] for k in ("layers", "heads", "head_dim", "ffn_dim", "frames", "height",
                                                       "width", "chunk", "steps", "text_len", "text_dim",
                                                       "freq_dim")})
    analytic, start = 0, 0
    for k, size in enumerate(realtime["chunk_sizes"]):
        attended = min(start + size, shape["window_frames"]) * preset.frame_tokens
        analytic += (shape["steps"] + 1) * benchmark.forward_flops(preset, size * preset.frame_tokens, attended,
                                                                   project_text_kv=k == 0, per_token_timesteps=False)
        start += size
    assert rows["eager"]["flops"] == analytic
    assert rows["cfg batched"]["flops"] == 2 * analytic  # both tags' rows, one batch
    assert rows["eager"]["decode_flops"] > 0


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    benchmark = _load_benchmark(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before checking for matplotlib")

    monkeypatch.setattr(benchmark, "measure_rollouts", no_run)
    with pytest.raises(SystemExit) as exited:
        benchmark.main(["--size", "tiny", "--plot", "chunks.png"])
    assert exited.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
