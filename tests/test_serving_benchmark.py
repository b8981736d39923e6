"""benchmarks/serving.py runs at its tiny shape and emits one JSON line with every field (no timing assertions: speed
is the benchmark's business); --device cuda without a GPU says so."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"
MODES = {"batched", "one after another"}
FIELDS = {"video_frames_per_second", "video_frames_per_cpu_second", "time_to_first_frame_seconds",
          "worst_time_to_first_frame_seconds", "chunk_latency_seconds", "cache_bytes_per_session",
          "session_bytes_per_session"}


@pytest.fixture
def serving(monkeypatch):
    """The script as a module, run in this process (it sets torch's thread count: restored afterwards)."""
    spec = importlib.util.spec_from_file_location("serving_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


def test_tiny_run_reports_both_modes_their_ratios_and_equal_latents(serving, capsys):
    report = serving.main(["--shape", "tiny", "--sessions", "1", "2", "--repeats", "1"])
    stdout = capsys.readouterr().out
    assert json.loads(stdout.strip().splitlines()[-1]) == report
    assert report["shape_name"] == "tiny" and report["device"] == "cpu" and report["date"]
    assert "no GPU used" in stdout and "ratios are batched / one after another" in stdout
    assert set(report["sessions"]) == {"1", "2"}
    for row in report["sessions"].values():
        assert set(row) == MODES | {"batched / one after another", "max_abs_latent_difference"}
        for mode in MODES:
            assert set(row[mode]) == FIELDS and all(row[mode][f] > 0 for f in FIELDS)
        # The same sessions hold the same cache either way, and their latents agree.
        assert row["batched"]["cache_bytes_per_session"] == row["one after another"]["cache_bytes_per_session"]
        assert row["batched / one after another"]["cache_bytes_per_session"] == 1
        assert row["max_abs_latent_difference"] <= 1e-5
        assert all(v > 0 for v in row["batched / one after another"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the cuda shape would run")
def test_cuda_without_a_gpu_says_so(serving, capsys):
    with pytest.raises(SystemExit) as exited:
        serving.main(["--device", "cuda"])
    assert exited.value.code == 2 and "needs a GPU and none is available here" in capsys.readouterr().err
