"""benchmarks/gpu_check.py on a machine without CUDA says so and exits cleanly, without the optional backends'
import noise."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_without_cuda_it_says_so_and_exits_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout
    for noise in ("Failed to load", "Unable to import `torchao`", "Enum subclass"):
        assert noise not in done.stderr
