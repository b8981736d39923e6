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


def test_tiny_benchmark_emits_every_cpu_field():
    run = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--device", "cpu", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(run.stdout.strip().splitlines()[-1])
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
    assert "cuda_wan2.1_1.3b" not in report and "compile" not in report
    assert "no-cache / cached" in run.stdout  # the table precedes the JSON
    assert report["targets_judged"] is False and "not judged at --size tiny" in run.stdout
    assert "--size tiny is a smoke test" in run.stdout


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("rollout_benchmark", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # its dataclasses look their module up there
    spec.loader.exec_module(benchmark)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before checking for matplotlib")

    monkeypatch.setattr(benchmark, "measure_rollouts", no_run)
    with pytest.raises(SystemExit) as exited:
        benchmark.main(["--size", "tiny", "--plot", "chunks.png"])
    assert exited.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
