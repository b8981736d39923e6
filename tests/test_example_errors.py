"""``examples/causal_rollout.py``: every error in what it is given ends it with one line, ``error: ...``, and exit
status 1 (#26 case 8), never a traceback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "causal_rollout.py"


def _example():
    spec = importlib.util.spec_from_file_location("causal_rollout_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fails(argv, tmp_path) -> str:
    """The one line the example ends with (a ``SystemExit`` with a message exits with status 1)."""
    with pytest.raises(SystemExit) as exited:
        _example().main([*argv, "--output", str(tmp_path / "out.mp4")])
    message = exited.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def test_a_checkpoint_that_does_not_exist_is_one_line_exit_1(tmp_path):
    """The issue's command (before: a FileNotFoundError traceback from inside the converter)."""
    run = subprocess.run([sys.executable, str(EXAMPLE), "--checkpoint", "does/not/exist", "--model-id",
                          str(tmp_path / "base")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 1 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == ("error: --checkpoint 'does/not/exist' does not exist; pass a converted folder (python -m "
                    "diffusers_causal_kv.convert) or a peer's checkpoint file.")


def test_a_checkpoint_file_that_does_not_convert(tmp_path):
    (tmp_path / "notes.pt").write_bytes(b"not a checkpoint")
    message = _fails(["--checkpoint", str(tmp_path / "notes.pt"), "--model-id", str(tmp_path)], tmp_path)
    assert message.startswith(f"error: could not convert --checkpoint {str(tmp_path / 'notes.pt')!r}: ")
    assert "notes.pt" in message.split(": ", 1)[1]  # the converter's own reason, naming the file
    assert not (tmp_path / "notes.pt.diffusers").exists()  # nothing half-converted left behind


def test_a_checkpoint_folder_that_is_no_model(tmp_path):
    (tmp_path / "folder").mkdir()
    message = _fails(["--checkpoint", str(tmp_path / "folder"), "--model-id", str(tmp_path)], tmp_path)
    assert message.startswith(f"error: could not load --checkpoint {str(tmp_path / 'folder')!r}: ")


@pytest.mark.parametrize("argv, says", [
    (["--num-frames", "abc"], "argument --num-frames: invalid positive_int value: 'abc'"),
    (["--chunk-frames", "0"], "argument --chunk-frames: must be a positive int, got 0"),
    (["--fps", "-1"], "argument --fps: must be a positive int, got -1"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--height", "30"], "height and width must be multiples of 16, got 30 x 64"),
    (["--timesteps", "2000"], "timesteps must be a non-empty list of finite numbers in (0, 1000], got [2000.0]"),
    (["--guidance-scale", "nan"], "guidance_scale must be a finite number, got nan"),
], ids=["not-a-number", "zero-chunk", "negative-fps", "unknown-flag", "height", "timesteps", "nan-guidance"])
def test_bad_arguments_are_one_line(tmp_path, argv, says):
    assert says in _fails(["--random", "--num-frames", "5", *argv], tmp_path)


@pytest.mark.parametrize("where", ["missing/out.mp4", "file/out.mp4"])
def test_an_output_it_cannot_write_is_one_line_before_any_work(tmp_path, where):
    (tmp_path / "file").write_text("a file, not a folder")
    output = str(tmp_path / where)
    with pytest.raises(SystemExit) as exited:
        _example().main(["--random", "--num-frames", "5", "--output", output])
    assert str(exited.value.code).startswith(f"error: --output {output!r} cannot be written: ")
