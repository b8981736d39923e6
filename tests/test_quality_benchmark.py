"""benchmarks/quality.py at a small size: every setting of the table runs and is scored (the past-RoPE absolute row
is the documented error), the JSON line carries it, and --plot draws the long-rollout metrics (no quality
thresholds here: tests/test_tiny_sprites.py holds those)."""

import importlib.util
import json
import shutil
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
    result = quality.main(["--chunks", "3", "--prompts", "1", "--windows", "6", "--sink", "3",
                           "--plot", str(plot), "--plot-chunks", "4",
                           "--threads", str(torch.get_num_threads())])  # the suite's thread count unchanged
    rows = result["rows"]
    assert set(rows) == {
        "bidirectional (all frames at once)", "causal, full cache", "causal, full cache, fp8 K/V", "rolling W=6",
        "rolling W=6 sink 3", "past RoPE (34 fr) absolute W=6", "past RoPE (34 fr) relative W=6",
        "prompt switch, re-cache W=6", "prompt switch, no re-cache W=6", "rolling forcing, full cache (untuned)"}
    assert "RoPE table" in rows["past RoPE (34 fr) absolute W=6"]["error"]  # absolute positions stop there
    for name, row in rows.items():
        if name != "past RoPE (34 fr) absolute W=6":  # every other setting runs: an error row is a failure
            assert set(row) == METRICS, (name, row)
            assert 0 <= row["present"] <= 1 and row["pixel_drift"] >= 0, name
    assert 0 <= result["vae_floor_physics_px"] < 0.5  # the VAE reconstructs the task's clips almost exactly
    assert set(result["long"]) == {"W=6", "W=6 sink 3"}
    assert plot.stat().st_size > 0
    out = capsys.readouterr().out
    assert "setting" in out and json.loads(out.strip().splitlines()[-1])["rows"].keys() == rows.keys()
    following = result["following"][0]  # the prompt-following table at seed 0 (the default)
    assert following["videos"] == len(quality.FOLLOW_PROMPTS) == 8
    for name in ("present", "colour", "shape"):
        assert 0 <= following[name] <= 1, name
    assert 0 <= following["direction"] <= 8 and following["speed"] >= 0
    assert following["switch_chunks"] is None or following["switch_chunks"] >= 1
    assert "prompt following" in out


def test_the_judge_scores_the_task_s_own_videos_as_following_their_prompts():
    """The prompt-following judge (``examples/sprites/judge.py``) against the rendered task: every frame has the
    sprite in its prompt's colour and shape, every video starts off the prompt's way (bounces in its first three
    frames included), the median speed is the task's; a wrong prompt or an empty frame is scored as such."""
    sys.path.insert(0, str(SCRIPT.parents[1] / "examples"))
    import numpy as np
    from sprites import judge, task

    rng = np.random.default_rng(0)
    clips = [task.sample_clip(24, rng, task.PROMPTS[i % len(task.PROMPTS)]) for i in range(96)]
    right = judge.summary([judge.judge(c.frames, c.prompts[0]) for c in clips])
    assert (right["present"], right["colour"], right["shape"], right["direction"]) == (1.0, 1.0, 1.0, 96)
    assert abs(right["speed_ratio"] - 1) < 0.05
    other = {"red": "blue", "green": "yellow", "blue": "red", "yellow": "green"}
    wrong = [task.Sprite(other[s.colour], "square" if s.shape == "ball" else "ball",
                         {"left": "right", "right": "left", "up": "down", "down": "up"}[s.direction]).prompt
             for s in (task.Sprite.parse(c.prompts[0]) for c in clips)]
    scored = judge.summary([judge.judge(c.frames, p) for c, p in zip(clips, wrong)])
    # a sprite that bounces in its first three frames, or starts by the wall it comes from, may pass the reversed prompt
    assert (scored["present"], scored["colour"], scored["shape"]) == (1.0, 0.0, 0.0) and scored["direction"] < 48
    blank = judge.judge(np.tile(np.array(task.BACKGROUND, dtype=np.float32), (6, task.SIZE, task.SIZE, 1)),
                        "red ball moving right")
    assert not blank.present.any() and not blank.direction_right


def test_plot_without_matplotlib_fails_before_the_run(quality, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed

    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before checking for matplotlib")

    monkeypatch.setattr(quality, "Bench", no_run)
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        quality.main(["--plot", "quality.png"])

def test_a_crop_s_moving_prompt_names_the_way_its_sprite_moves_after_a_bounce():
    """The training script's crop prompts (``Clip.moving_prompt``): a clip's own prompt names its initial direction,
    wrong for ~40% of mid-clip crops (every 25-frame clip bounces off the wall ahead); the moving prompt is right for
    every crop, as the judge scores a video's first three frames."""
    sys.path.insert(0, str(SCRIPT.parents[1] / "examples"))
    import numpy as np
    from sprites import judge, task

    rng = np.random.default_rng(1)
    clips = [task.sample_clip(25, rng, switch_at=12 if i % 4 == 0 else None) for i in range(64)]
    crops = [(c, o) for c in clips for o in range(0, 14, 3)]
    moving = judge.summary([judge.judge(c.frames[o:o + 6], c.moving_prompt(o)) for c, o in crops])
    initial = judge.summary([judge.judge(c.frames[o:o + 6], c.prompts[o]) for c, o in crops])
    assert moving["direction"] == len(crops)
    assert initial["direction"] < 0.8 * len(crops)
    assert all(c.moving_prompt(o).split()[:2] == c.prompts[o].split()[:2] for c, o in crops)  # colour, shape kept


def test_a_model_whose_chunks_vary_after_the_first_is_refused(quality, tmp_path):
    """The table's metrics read a first chunk and one size after it: a plan such as 1, 2, 3 is refused, by name."""
    model = tmp_path / "model"
    shutil.copytree(quality.ROOT / "models" / "tiny-sprites", model)
    config = json.loads((model / "causal_config.json").read_text())
    config.update(chunk_frames=[1, 2, 3] + [3] * 6, num_frames=24)
    (model / "causal_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"one size after the first, not \[1, 2, 3, 3"):
        quality.Bench(str(model), ["red ball moving right"], seed=0)
