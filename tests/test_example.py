"""The examples run end to end and write playable mp4s."""

import importlib.util
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str = "causal_rollout"):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_writes_a_playable_mp4(tmp_path, capsys):
    output = tmp_path / "rollout.mp4"
    _load().main(["--output", str(output), "--num-frames", "17", "--chunk-frames", "2", "--guidance-scale", "2"])
    frames = iio.imread(output)
    assert frames.shape == (17, 64, 64, 3)
    assert frames.std() > 1  # decoded content, not a blank video
    printed = capsys.readouterr().out
    assert "chunks (latent frames): [3, 2]" in printed and "chunk 1: 2 frames" in printed


def test_vace_example_writes_a_playable_mp4_steered_by_the_control(tmp_path, capsys):
    output, control = tmp_path / "vace.mp4", tmp_path / "depth.mp4"
    _load("causal_vace_rollout").main(["--output", str(output), "--control-output", str(control),
                                       "--num-frames", "17", "--chunk-frames", "2"])
    frames, depth = iio.imread(output), iio.imread(control)
    assert frames.shape == depth.shape == (17, 64, 64, 3)
    assert frames.std() > 1
    assert not np.allclose(depth[0], depth[-1], atol=10)  # the square moved
    printed = capsys.readouterr().out
    assert "chunks (latent frames): [3, 2]" in printed
    assert "'main' cache:" in printed and "'vace' cache:" in printed


def test_train_step_example_gives_the_same_losses_with_gradient_checkpointing(capsys):
    train_step = _load("train_step")
    plain = train_step.main(["--latent-frames", "4", "--chunk-frames", "2"])
    ckpt = train_step.main(["--latent-frames", "4", "--chunk-frames", "2", "--gradient-checkpointing"])
    assert all(0 < v < float("inf") for v in plain.values())
    assert ckpt == pytest.approx(plain, rel=1e-5)
    printed = capsys.readouterr().out
    assert "teacher forcing: flow-matching loss" in printed and "self forcing: DMD loss" in printed
