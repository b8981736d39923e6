"""The examples run end to end and write playable mp4s."""

import importlib.util
import os
import subprocess
import sys
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


def test_example_writes_a_playable_mp4_of_the_sprite_model_by_default(tmp_path, capsys):
    output, strip = tmp_path / "rollout.mp4", tmp_path / "strip.png"
    _load().main(["--output", str(output), "--strip", str(strip), "--strip-frames", "6"])
    frames = iio.imread(output)
    assert frames.shape[1:] == (32, 32, 3) and len(frames) >= 24  # the model's 32x32 frames, 8 chunks of 3
    assert frames.std() > 1
    assert iio.imread(strip).shape == (4 * 32, 6 * 4 * 32 + 5 * 2, 3)  # 6 frames scaled 4x, 2-pixel gaps
    printed = capsys.readouterr().out
    assert "the tiny sprite model of models/tiny-sprites: 'red ball moving right'" in printed
    assert "random weights" not in printed


def test_example_writes_a_playable_mp4_with_random_components(tmp_path, capsys):
    output = tmp_path / "rollout.mp4"
    _load().main(["--random", "--output", str(output), "--num-frames", "17", "--chunk-frames", "2",
                  "--guidance-scale", "2"])
    frames = iio.imread(output)
    assert frames.shape == (17, 64, 64, 3)
    assert frames.std() > 1  # decoded content, not a blank video
    printed = capsys.readouterr().out
    assert "chunks (latent frames): [3, 2]" in printed and "chunk 1: 2 frames" in printed
    assert "random weights: the video is noise" in printed


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


def test_long_rollout_example_keeps_memory_flat_across_a_prompt_switch(tmp_path, capsys):
    output = tmp_path / "long.mp4"
    _load("long_rollout").main(["--output", str(output), "--num-chunks", "34", "--switch-at", "17",
                                "--memory-every", "17", "--window-frames", "4", "--timesteps", "1000"])
    frames = iio.imread(output)
    assert frames.shape == (4 * 34 - 3, 32, 32, 3)  # 34 latent frames, past the 32-position RoPE table
    assert frames.std() > 1
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if "memory_bytes()=" in line]
    assert len(lines) == 2 and len({line.split("memory_bytes()=")[1].split()[0] for line in lines}) == 1
    assert "switched prompt" in printed and "cache memory over 34 chunks: flat" in printed


@pytest.mark.parametrize("name", ["causal_rollout", "causal_vace_rollout", "long_rollout"])
def test_an_unloadable_model_id_ends_the_example_with_one_clear_line(name, tmp_path):
    # Local paths only, so nothing reaches the network: a missing folder, and a folder without a checkpoint.
    for model_id in (tmp_path / "no-such-checkpoint", tmp_path):
        with pytest.raises(SystemExit) as exited:
            _load(name).main(["--model-id", str(model_id), "--output", str(tmp_path / "out.mp4")])
        message = exited.value.code  # SystemExit(str): Python prints it to stderr and exits with status 1
        assert isinstance(message, str) and "\n" not in message
        assert message.startswith(f"error: could not load --model-id {str(model_id)!r}")
        assert "network access to the Hugging Face hub" in message and "local folder" in message


def test_an_unloadable_model_id_exits_non_zero_without_a_traceback(tmp_path):
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "causal_rollout.py"), "--model-id", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and "FutureWarning" not in run.stderr  # no torch_dtype deprecation
    assert run.stderr.strip().splitlines()[-1].startswith("error: could not load --model-id")


def test_example_runs_a_causal_checkpoint_folder_with_base_components(tmp_path, capsys):
    """``--checkpoint`` (a converted transformer folder with its causal_config.json) plus ``--model-id`` (a local
    stock WanPipeline folder for the text encoder, tokenizer and VAE)."""
    from diffusers import WanPipeline

    from diffusers_causal_kv import CausalConfig
    from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan

    WanPipeline(**tiny_pipeline_components()).save_pretrained(tmp_path / "base")
    causal = tiny_wan(seed=7)
    causal.save_pretrained(tmp_path / "causal")
    CausalConfig(chunk_frames=2, timesteps=(1000, 500), num_frames=13).save(tmp_path / "causal")
    output = tmp_path / "out.mp4"
    _load().main(["--checkpoint", str(tmp_path / "causal"), "--model-id", str(tmp_path / "base"),
                  "--output", str(output), "--height", "32", "--width", "32"])
    assert iio.imread(output).shape == (13, 32, 32, 3)
    printed = capsys.readouterr().out
    assert "chunks (latent frames): [2, 2]" in printed and "random weights" not in printed
    assert "chunk 1: 2 frames" in printed


def test_example_refuses_a_checkpoint_without_base_components(tmp_path):
    with pytest.raises(SystemExit) as exited:
        _load().main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "out.mp4")])
    assert "pass --model-id for the base Wan components" in str(exited.value.code)


def test_example_converts_a_peer_checkpoint_file_on_the_fly(tmp_path, capsys):
    """``--checkpoint`` a Self-Forcing ``.pt`` (a model with Wan's head dim 128, so its config is inferred as for a
    real one): converted next to it once, with the peer's sampling settings, then run."""
    import sys

    from diffusers import WanPipeline

    from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan

    sys.path.insert(0, str(Path(__file__).parent))
    from convert_fixtures import write_wrapper

    WanPipeline(**tiny_pipeline_components()).save_pretrained(tmp_path / "base")
    causal = tiny_wan(head_dim=128, heads=1, ffn_dim=64, text_dim=32, seed=3)
    source = write_wrapper(tmp_path / "self_forcing_dmd.pt", causal, causal)
    output = tmp_path / "out.mp4"
    args = ["--checkpoint", source, "--model-id", str(tmp_path / "base"), "--output", str(output),
            "--height", "32", "--width", "32", "--num-frames", "25"]
    _load().main(args)
    assert (tmp_path / "self_forcing_dmd.pt.diffusers" / "causal_config.json").is_file()
    printed = capsys.readouterr().out
    assert "converting" in printed and "chunks (latent frames): [4, 3]" in printed
    assert iio.imread(output).shape == (25, 32, 32, 3)
    _load().main(args)  # the converted folder is reused
    assert "converting" not in capsys.readouterr().out
