"""benchmarks/quality.py at a small size: every setting of the table runs and is scored (the past-RoPE absolute row
is the documented error), the JSON line carries it, and --plot draws the long-rollout metrics (no quality
thresholds here: tests/test_tiny_sprites.py holds those)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py"
METRICS = {"present", "physics_px", "speed_px", "pixel_drift", "late_present", "late_physics_px", "late_speed_px",
           "late_pixel_drift", "seconds"}


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_quality_run_scores_every_setting_and_plots(quality, tmp_path, capsys):
    plot = tmp_path / "quality.png"
    result = quality.main(["--chunks", "2", "--prompts", "1", "--windows", "6", "--sink", "3",
                           "--plot", str(plot), "--plot-chunks", "4",
                           "--threads", str(torch.get_num_threads())])  # the suite's thread count unchanged
    rows = result["rows"]
    assert set(rows) == {
        "bidirectional (all frames at once)", "causal, full cache", "causal, full cache, fp8 K/V", "rolling W=6",
        "rolling W=6 sink 3", "past RoPE (36 fr) absolute W=6", "past RoPE (36 fr) relative W=6",
        "prompt switch, re-cache W=6", "prompt switch, no re-cache W=6", "rolling forcing, full cache (untuned)"}
    assert "RoPE table" in rows["past RoPE (36 fr) absolute W=6"]["error"]  # absolute positions stop there
    for name, row in rows.items():
        if "error" not in row:
            assert set(row) == METRICS, name
            assert 0 <= row["present"] <= 1 and row["pixel_drift"] >= 0, name
    assert 0 <= result["vae_floor_physics_px"] < 0.5  # the VAE reconstructs the task's clips almost exactly
    assert set(result["long"]) == {"W=6", "W=6 sink 3"}
    assert plot.stat().st_size > 0
    out = capsys.readouterr().out
    assert "setting" in out and json.loads(out.strip().splitlines()[-1])["rows"].keys() == rows.keys()


def test_plot_without_matplotlib_fails_before_the_run(quality, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before checking for matplotlib")

    monkeypatch.setattr(quality, "Bench", no_run)
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        quality.main(["--plot", "quality.png"])
