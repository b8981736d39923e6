"""``causal_config.json`` values are checked by type and range in one place, whichever way they come (#26 case 5):
``CausalConfig(...)``, the file, the converter's ``--set``. Property tests (hypothesis) over random configs: every
invalid one is refused with a ``ValueError`` naming each bad key, its value and what the key accepts; every valid one
round-trips through JSON (and the file) unchanged. The validity oracle here is written from the schema, apart from
the package's code."""

from __future__ import annotations

import json
import math
import numbers
import pathlib
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusers_causal_kv import CausalConfig, CausalWanPipeline
from diffusers_causal_kv.causal_config import ACCEPTED
from diffusers_causal_kv.convert.__main__ import main as convert_main
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan


def _is_count(value, least=1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_list(value, item) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(item(v) for v in value)


VALID = {
    "chunk_frames": lambda v: _is_count(v) or _is_list(v, _is_count),
    "timesteps": lambda v: _is_list(v, lambda t: _is_number(t) and 0 < t <= 1000),
    "shift": lambda v: _is_number(v) and v > 0,
    "context_noise": lambda v: _is_number(v) and 0 <= v <= 1000,
    "context_noise_mode": lambda v: v in ("label", "renoise"),
    "guidance_scale": _is_number,
    "num_frames": _is_count,
    "window_frames": lambda v: v is None or _is_count(v),
    "sink_frames": lambda v: _is_count(v, least=0),
    "positions": lambda v: v in ("absolute", "relative"),
    "sampler": lambda v: v in ("chunkwise", "rolling_forcing"),
    "first_chunk_timesteps": lambda v: v is None or _is_list(v, lambda t: _is_number(t) and 0 < t <= 1000),
    "source": lambda v: v is None or isinstance(v, str),
}
numbers_ = st.one_of(st.integers(-3, 1200), st.floats(allow_nan=True, allow_infinity=True), st.booleans())
anything = st.one_of(st.none(), numbers_, st.text(max_size=6), st.lists(st.one_of(numbers_, st.text(max_size=2)),
                     max_size=4), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
# Values each key accepts.
good = {
    "chunk_frames": st.one_of(st.integers(1, 9), st.lists(st.integers(1, 9), min_size=1, max_size=5)),
    "timesteps": st.lists(st.floats(0, 1000, exclude_min=True) | st.integers(1, 1000), min_size=1, max_size=5),
    "shift": st.floats(0, 50, exclude_min=True) | st.integers(1, 20),
    "context_noise": st.floats(0, 1000) | st.integers(0, 1000),
    "context_noise_mode": st.sampled_from(["label", "renoise"]),
    "guidance_scale": st.floats(-10, 10) | st.integers(-2, 10),
    "num_frames": st.integers(1, 500),
    "window_frames": st.none() | st.integers(1, 40),
    "sink_frames": st.integers(0, 8),
    "positions": st.sampled_from(["absolute", "relative"]),
    "sampler": st.sampled_from(["chunkwise", "rolling_forcing"]),
    "first_chunk_timesteps": st.none() | st.lists(st.floats(0, 1000, exclude_min=True) | st.integers(1, 1000),
                                                  min_size=1, max_size=5),
    "source": st.none() | st.text(max_size=8),
}


def _invalid_keys(values: dict) -> list[str]:
    return [key for key, value in values.items() if not VALID[key](value)]


def _sink_fills_window(values: dict) -> bool:
    window, sink = values.get("window_frames"), values.get("sink_frames", 0)
    return window is not None and sink >= window


valid_configs = st.fixed_dictionaries({}, optional=good).filter(lambda values: not _sink_fills_window(values))


@st.composite
def invalid_configs(draw):
    """A valid config with some keys given values they do not accept, or (one in four) a sink filling the window."""
    values = draw(valid_configs)
    if draw(st.integers(0, 3)) == 0:
        window = draw(st.integers(1, 12))
        return {**values, "window_frames": window, "sink_frames": draw(st.integers(window, 16))}
    for key in draw(st.lists(st.sampled_from(sorted(ACCEPTED)), min_size=1, max_size=3, unique=True)):
        values[key] = draw(anything.filter(lambda value, key=key: not VALID[key](value)))
    return values


# Plain-Python checks: no deadline, and the strategy's first draws (building its text alphabet) may be slow.
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@EXAMPLES
@given(invalid_configs())
def test_every_invalid_config_is_refused_naming_key_value_and_what_is_accepted(values):
    bad = _invalid_keys(values)
    assert bad or _sink_fills_window(values)  # invalid by the oracle
    for build in (lambda: CausalConfig(**values), lambda: CausalConfig.from_dict(values, origin="test.json")):
        with pytest.raises(ValueError, match="invalid causal config") as caught:
            build()
        message = str(caught.value)
        assert "\n" not in message
        for key in bad:
            assert f"{key} must be {ACCEPTED[key]}, got {values[key]!r}" in message
        if not bad:
            assert f"sink_frames ({values['sink_frames']}) must be below window_frames" in message


@EXAMPLES
@given(valid_configs)
def test_every_valid_config_round_trips_through_json_unchanged(values):
    assert not _invalid_keys(values)  # valid by the oracle
    config = CausalConfig.from_dict(values)
    assert config == CausalConfig(**values)
    text = json.dumps(config.to_dict(), allow_nan=False)  # strict JSON: no NaN, no Infinity
    again = CausalConfig.from_dict(json.loads(text))
    assert again == config and again.to_dict() == config.to_dict() and again.source == config.source
    with tempfile.TemporaryDirectory() as folder:
        config.save(folder)
        assert CausalConfig.load(folder).to_dict() == config.to_dict()
    for key, value in values.items():  # what was given, as numbers: nothing rounded or dropped
        stored = config.to_dict()[key]
        assert stored == (list(value) if isinstance(value, tuple) else value), key


# ---------------------------------------------------------------------------------------------- the issue's cases
@pytest.mark.parametrize("values, named", [
    ({"shift": "abc"}, "shift must be a finite number > 0, got 'abc'"),
    ({"timesteps": 1000}, "timesteps must be a non-empty list of finite numbers in (0, 1000], got 1000"),
    ({"context_noise": "0"}, "context_noise must be a finite number in [0, 1000], got '0'"),
    ({"guidance_scale": "high"}, "guidance_scale must be a finite number, got 'high'"),
    ({"shift": float("nan")}, "shift must be a finite number > 0, got nan"),
    ({"shift": float("inf")}, "shift must be a finite number > 0, got inf"),
    ({"num_frames": True}, "num_frames must be a positive int, got True"),
    ({"chunk_frames": [1, 0]}, "chunk_frames must be a positive int, or a non-empty list of positive ints"),
])
def test_the_issues_values_are_refused_with_a_value_error(values, named):
    """Before: a raw TypeError (shift="abc", timesteps=1000, context_noise="0"), or accepted (guidance_scale="high"
    failing at call time; NaN / Infinity making an all-NaN video)."""
    with pytest.raises(ValueError, match="invalid causal config") as caught:
        CausalConfig(**values)
    assert named in str(caught.value)


@pytest.mark.parametrize("text", ['{"shift": NaN}', '{"shift": Infinity}', '{"context_noise": -Infinity}'])
def test_json_nan_and_infinity_are_refused_naming_the_file(tmp_path, text):
    (tmp_path / "causal_config.json").write_text(text)
    with pytest.raises(ValueError, match="invalid causal config in .*causal_config.json: .* got (nan|inf|-inf)"):
        CausalConfig.load(tmp_path)


def test_a_pipeline_call_override_is_checked_the_same_way():
    pipe = CausalWanPipeline(**tiny_pipeline_components(tiny_wan()), causal_config=CausalConfig(num_frames=5))
    with pytest.raises(ValueError, match="shift must be a finite number > 0, got nan"):
        pipe("a", height=32, width=32, shift=float("nan"), output_type="latent")


def test_chunk_frames_may_be_the_list_of_chunk_sizes_a_call_takes(tmp_path):
    config = CausalConfig(chunk_frames=[1, 2], timesteps=(1000, 500), num_frames=9)  # 9 video = 3 latent frames
    config.save(tmp_path)
    assert CausalConfig.load(tmp_path) == config and config.chunk_frames == (1, 2)
    pipe = CausalWanPipeline(**tiny_pipeline_components(tiny_wan()), causal_config=CausalConfig.load(tmp_path))
    pipe("a", height=32, width=32, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert pipe.chunk_sizes == [1, 2]


@pytest.mark.parametrize("setting, named", [
    ("shift=abc", "shift must be a finite number > 0, got 'abc'"),
    ("shift=NaN", "shift must be a finite number > 0, got nan"),
    ("timesteps=1000", "timesteps must be a non-empty list of finite numbers in (0, 1000], got 1000"),
    ("chunk_size=3", "has unknown keys ['chunk_size']"),
])
def test_the_converters_set_errors_are_one_line_and_exit_1(tmp_path, capsys, setting, named):
    src = tmp_path / "self_forcing_dmd.pt"
    src.write_bytes(b"")  # never read: the setting is refused before any work
    assert convert_main([str(src), str(pathlib.Path(tmp_path) / "out"), "--set", setting]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and named in error
    assert not (tmp_path / "out").exists()
