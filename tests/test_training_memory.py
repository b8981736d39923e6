"""benchmarks/training_memory.py runs and reports what checkpointing saves (exact byte counts, no timings)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training_memory.py"


def test_training_memory_report(capsys):
    spec = importlib.util.spec_from_file_location("training_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--size", "tiny"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    chunks = report["chunks"]
    assert [c["start_frame"] for c in chunks] == [0, 2, 4]
    plain = [c["saved_bytes"] for c in chunks]
    assert plain == sorted(plain) and plain[0] < plain[-1]  # attention over a longer prefix saves more
    assert all(c["saved_bytes_checkpointing"] < c["saved_bytes"] / 4 for c in chunks)
