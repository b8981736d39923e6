"""Checkpoint conversion: each peer's release layout, synthesized from a tiny model, converts into a folder that stock
``WanTransformer3DModel.from_pretrained`` loads with no missing or unexpected keys and that computes exactly what
the source model computes; LoRAs merge (or load as a switchable adapter) like PEFT applies them; fp8 weights
dequantize to what their scales say; the two experts of a Wan2.2 A14B checkpoint convert together or not at all;
broken and mismatched files fail naming the file and the keys."""

from __future__ import annotations

import builtins
import errno
import json
import os
import pathlib
import shlex
from unittest import mock

import pytest
import safetensors.torch
import torch
from convert_fixtures import (
    HEADS,
    add_random_lora,
    fp8_scaled_state,
    inputs,
    longlive_lora_file,
    lora_state_file,
    original_state_dict,
    output,
    save_pt,
    wrapper_state,
    write_diffusers_experts,
    write_model_index,
    write_original_experts,
    write_safetensors_shards,
    write_wrapper,
)
from diffusers import WanTransformer3DModel
from safetensors import safe_open
from safetensors.torch import save_file

from diffusers_causal_kv import CausalConfig
from diffusers_causal_kv.convert import FORMATS, LORA_WEIGHT_NAME, convert_checkpoint
from diffusers_causal_kv.convert.__main__ import main
from diffusers_causal_kv.testing import tiny_wan


def _model(seed=0, **config):
    # Wan's RoPE table length: the converter cannot read it from the weights and writes Wan's default.
    return tiny_wan(seed=seed, rope_max_seq_len=1024, **config)


def _load(out, subfolder=None) -> WanTransformer3DModel:
    model, info = WanTransformer3DModel.from_pretrained(out, subfolder=subfolder, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == []
    # from_pretrained leaves the weights in the memory-mapped file, unaligned, where CPU kernels round differently:
    # give them their own storage so that bitwise comparisons compare the arithmetic only.
    for param in model.parameters():
        param.data = param.data.clone()
    return model.eval()


def _assert_same_outputs(converted, source):
    kwargs = inputs(source)
    assert torch.equal(output(converted, kwargs), output(source, kwargs))


def _convert(src, out, **kwargs):
    return convert_checkpoint(src, out, num_attention_heads=HEADS, **kwargs)


# ---------------------------------------------------------------------------------------------- the peers' layouts
def test_self_forcing_converts_the_ema_weights_by_default(tmp_path):
    generator, ema = _model(seed=0), _model(seed=1)
    src = write_wrapper(tmp_path / "checkpoints" / "self_forcing_dmd.pt", generator, ema)

    out = _convert(src, tmp_path / "ema")
    _assert_same_outputs(_load(out), ema)
    assert CausalConfig.load(out) == FORMATS["self_forcing"].sampling
    assert CausalConfig.load(out).source == "self_forcing"

    out = _convert(src, tmp_path / "generator", ema=False)
    _assert_same_outputs(_load(out), generator)


def test_causal_forcing_keeps_the_self_forcing_layout_behind_training_wrappers(tmp_path):
    generator, ema = _model(seed=0), _model(seed=1)
    # FSDP / torch.compile name segments inside the wrapper's "model." prefix
    src = write_wrapper(tmp_path / "chunkwise" / "causal_forcing.pt", generator, ema,
                        inner="_orig_mod._fsdp_wrapped_module.")
    out = _convert(src, tmp_path / "out")
    _assert_same_outputs(_load(out), generator)  # its chunk-wise inference loads the non-EMA weights
    assert CausalConfig.load(out).source == "causal_forcing"


def test_causvid_autoregressive_checkpoint(tmp_path):
    generator = _model(seed=2)
    src = write_wrapper(tmp_path / "autoregressive_checkpoint" / "model.pt", generator)
    out = _convert(src, tmp_path / "out")
    _assert_same_outputs(_load(out), generator)
    config = CausalConfig.load(out)
    assert config == FORMATS["causvid"].sampling and config.timesteps == (1000.0, 757.0, 522.0)


def test_krea_safetensors_of_its_wrapper(tmp_path):
    model = _model(seed=3)
    src = tmp_path / "checkpoints" / "krea-realtime-video-14b.safetensors"
    src.parent.mkdir()
    save_file(original_state_dict(model, prefix="model."), src)
    out = _convert(src, tmp_path / "out")
    _assert_same_outputs(_load(out), model)
    assert CausalConfig.load(out) == FORMATS["krea"].sampling


def test_sharded_original_wan_i2v_folder(tmp_path):
    model = _model(seed=4, i2v=True)
    write_safetensors_shards(tmp_path / "Wan2.1-I2V", original_state_dict(model), shards=3)
    out = _convert(tmp_path / "Wan2.1-I2V", tmp_path / "out")  # the folder: its index json is found
    converted = _load(out)
    assert converted.config.image_dim == 8 and converted.config.added_kv_proj_dim == 24
    _assert_same_outputs(converted, model)
    assert CausalConfig.load(out).source == "wan"


def test_heads_default_to_wans_head_dim_of_128(tmp_path):
    model = _model(seed=5, head_dim=128, heads=2, layers=1)
    src = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(original_state_dict(model), src)
    converted = _load(convert_checkpoint(src, tmp_path / "out"))
    assert (converted.config.num_attention_heads, converted.config.attention_head_dim) == (2, 128)
    _assert_same_outputs(converted, model)


# ---------------------------------------------------------------------------------------------- LongLive's LoRA
@pytest.fixture
def longlive(tmp_path):
    """LongLive's release of a tiny model: base weights, a LoRA (rank 4, alpha 8), and the same LoRA applied by
    PEFT to the source model as the reference."""
    base = _model(seed=6)
    src = write_wrapper(tmp_path / "longlive_models" / "models" / "longlive_base.pt", base)
    reference = _model(seed=6)
    add_random_lora(reference, rank=4, alpha=8.0)
    lora = longlive_lora_file(tmp_path / "longlive_models" / "models" / "lora.pt", reference)
    return base, reference, src, lora


def test_longlive_lora_merged(longlive, tmp_path):
    base, reference, src, lora = longlive
    out = _convert(src, tmp_path / "merged", lora=lora, lora_alpha=8.0)
    kwargs = inputs(base)
    torch.testing.assert_close(output(_load(out), kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)
    assert CausalConfig.load(out) == FORMATS["longlive"].sampling
    assert not os.path.exists(os.path.join(out, LORA_WEIGHT_NAME))


def test_longlive_lora_alpha_defaults_to_the_rank(longlive, tmp_path):
    base, reference, src, lora = longlive
    out = _convert(src, tmp_path / "merged", lora=lora)  # LongLive's alpha = rank: scale 1, half of alpha 8 / rank 4
    reference.set_adapters(["default"], weights=[0.5])
    kwargs = inputs(base)
    torch.testing.assert_close(output(_load(out), kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)


def test_longlive_lora_as_a_switchable_adapter(longlive, tmp_path):
    base, reference, src, lora = longlive
    out = _convert(src, tmp_path / "adapter", lora=lora, lora_mode="adapter", lora_alpha=8.0)
    model = _load(out)
    kwargs = inputs(base)
    assert torch.equal(output(model, kwargs), output(base, kwargs))  # the base weights, untouched

    model.load_lora_adapter(out, weight_name=LORA_WEIGHT_NAME, prefix="transformer", adapter_name="longlive")
    torch.testing.assert_close(output(model, kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)
    merged = _load(_convert(src, tmp_path / "merged", lora=lora, lora_alpha=8.0))
    torch.testing.assert_close(output(model, kwargs), output(merged, kwargs), atol=1e-5, rtol=1e-5)
    model.disable_adapters()
    assert torch.equal(output(model, kwargs), output(base, kwargs))
    model.enable_adapters()
    torch.testing.assert_close(output(model, kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- command line
def test_cli_writes_bf16_shards_and_a_causal_config(tmp_path):
    model = _model(seed=7)
    src = write_wrapper(tmp_path / "autoregressive_checkpoint" / "model.pt", model)
    out = tmp_path / "out"
    assert main([str(src), str(out), "--format", "causvid", "--dtype", "bfloat16", "--max-shard-size", "20KB",
                 "--num-attention-heads", str(HEADS), "--set", "num_frames=49", "--set", "timesteps=[1000, 500]"]) == 0

    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    dtypes = {}
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            dtypes.update({key: f.get_slice(key).get_dtype() for key in f.keys()})  # noqa: SIM118
    kept = [key for key in dtypes if any(part in WanTransformer3DModel._keep_in_fp32_modules for part in
                                             key.split("."))]
    assert kept and all(dtypes[key] == "F32" for key in kept)  # as diffusers keeps them when loading in bf16
    assert {dtypes[key] for key in dtypes if key not in kept} == {"BF16"}

    loaded = WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    assert loaded.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert CausalConfig.load(out) == FORMATS["causvid"].sampling.replace(num_frames=49, timesteps=(1000, 500))


def test_cli_reports_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing.pt"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "no checkpoint at" in error and "missing.pt" in error


def test_sampling_settings_can_be_overridden(tmp_path):
    src = write_wrapper(tmp_path / "chunkwise" / "causal_forcing.pt", _model(), _model(seed=1))
    out = _convert(src, tmp_path / "framewise", ema=True, causal_config={"chunk_frames": 1})
    assert CausalConfig.load(out) == FORMATS["causal_forcing"].sampling.replace(chunk_frames=1)


# ---------------------------------------------------------------------------------------------- broken files
def _self_forcing(tmp_path, **state_changes):
    state = {"generator": {f"model.{k}": v for k, v in original_state_dict(_model()).items()}}
    for key, value in state_changes.items():
        if value is None:
            del state["generator"][key]
        else:
            state["generator"][key] = value
    return save_pt(tmp_path / "self_forcing_dmd.pt", state)


def test_truncated_file(tmp_path):
    src = write_wrapper(tmp_path / "self_forcing_dmd.pt", _model())
    data = pathlib.Path(src).read_bytes()
    pathlib.Path(src).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="could not be read as a checkpoint") as caught:
        _convert(src, tmp_path / "out")
    assert "self_forcing_dmd.pt" in str(caught.value) and "download it again" in str(caught.value)


def test_truncated_safetensors(tmp_path):
    src = tmp_path / "krea-realtime-video-14b.safetensors"
    save_file(original_state_dict(_model()), src)
    src.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(ValueError, match="could not be read as a checkpoint") as caught:
        _convert(src, tmp_path / "out")
    assert "krea-realtime-video-14b.safetensors" in str(caught.value)


@pytest.mark.parametrize("change, names", [
    ({"model.blocks.1.ffn.2.bias": None}, ["missing", "blocks.1.ffn.net.2.bias"]),
    ({"model.blocks.0.self_attn.lora_q.weight": torch.zeros(2)}, ["unmapped", "model.blocks.0.self_attn.lora_q"]),
    ({"model.blocks.1.ffn.0.weight": torch.zeros(7, 24)},
     ["shapes", "model.blocks.1.ffn.0.weight: (7, 24) vs (32, 24)"]),
], ids=["missing-key", "extra-key", "wrong-shape"])
def test_keys_that_do_not_map(tmp_path, change, names):
    src = _self_forcing(tmp_path, **change)
    with pytest.raises(ValueError, match="keys do not map onto WanTransformer3DModel") as caught:
        _convert(src, tmp_path / "out")
    message = str(caught.value)
    assert "self_forcing_dmd.pt['generator']" in message
    assert all(name in message for name in names), message
    assert not os.path.exists(tmp_path / "out")  # refused before anything was written


def test_wrong_format_forced(tmp_path):
    src = tmp_path / "krea-realtime-video-14b.safetensors"
    save_file(original_state_dict(_model()), src)
    with pytest.raises(ValueError, match="but format='longlive' expects a wrapper .pt") as caught:
        _convert(src, tmp_path / "out", format="longlive")
    assert "krea-realtime-video-14b.safetensors" in str(caught.value)


def test_unknown_layout_names_the_keys(tmp_path):
    src = save_pt(tmp_path / "vae.pt", {"encoder.conv1.weight": torch.zeros(1), "decoder.conv1.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a Wan checkpoint layout the converter knows") as caught:
        _convert(src, tmp_path / "out")
    assert "vae.pt" in str(caught.value) and "encoder.conv1.weight" in str(caught.value)


def test_diffusers_state_dict_is_pointed_to_from_pretrained(tmp_path):
    src = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(_model().state_dict(), src)
    with pytest.raises(ValueError, match="load its folder with from_pretrained"):
        _convert(src, tmp_path / "out")


def test_auto_cannot_tell_an_anonymous_wrapper(tmp_path):
    src = write_wrapper(tmp_path / "checkpoint_model_000600" / "model.pt", _model())
    with pytest.raises(ValueError, match="cannot tell which causal checkpoint"):
        _convert(src, tmp_path / "out")
    out = _convert(src, tmp_path / "out", format="self_forcing")  # no EMA in it: the generator
    assert CausalConfig.load(out).source == "self_forcing"


# ---------------------------------------------------------------------------------------------- LongLive 2.0 (TI2V-5B)
def _ti2v(seed=10):
    """A tiny Wan2.2-TI2V-5B: 48-channel latents in and out, no image embedder."""
    return _model(seed=seed, in_channels=48, out_channels=48)


def test_longlive2_merged_release_converts_to_a_ti2v_transformer(tmp_path):
    model = _ti2v()
    src = save_pt(tmp_path / "LongLive-2.0-5B" / "model_bf16.pt", {"generator": wrapper_state(model)})
    out = _convert(src, tmp_path / "out")
    converted = _load(out)
    config = converted.config
    assert (config.in_channels, config.out_channels, config.image_dim, config.added_kv_proj_dim) == (48, 48, None, None)
    _assert_same_outputs(converted, model)
    sampling = CausalConfig.load(out)
    assert sampling == FORMATS["longlive2"].sampling and sampling.source == "longlive2"
    assert (sampling.chunk_frames, sampling.window_frames, sampling.sink_frames) == (8, 32, 8)


@pytest.fixture
def longlive2(tmp_path):
    """LongLive 2.0's base generator and DMD LoRA (rank 4, alpha 4: LongLive's alpha = rank) for a tiny TI2V model,
    and the LoRA applied by PEFT as the reference."""
    base = _ti2v(seed=11)
    src = save_pt(tmp_path / "longlive2_models" / "generator.pt", {"generator": wrapper_state(base)})
    reference = _ti2v(seed=11)
    add_random_lora(reference, rank=4, alpha=4.0)
    lora = longlive_lora_file(tmp_path / "longlive2_models" / "lora.pt", reference)
    return base, reference, src, lora


def test_longlive2_base_and_lora_merge(longlive2, tmp_path):
    base, reference, src, lora = longlive2
    out = _convert(src, tmp_path / "out", lora=lora)
    assert CausalConfig.load(out).source == "longlive2"  # named longlive2: not LongLive 1's settings
    kwargs = inputs(base)
    torch.testing.assert_close(output(_load(out), kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)


def test_lora_only_checkpoint_merges_onto_its_base(longlive2, tmp_path):
    base, reference, src, lora = longlive2
    with pytest.raises(ValueError, match="holds only LoRA weights") as caught:
        _convert(lora, tmp_path / "refused")
    assert "lora.pt" in str(caught.value) and "--base" in str(caught.value)

    out = tmp_path / "out"
    assert main([lora, str(out), "--base", src, "--num-attention-heads", str(HEADS)]) == 0
    kwargs = inputs(base)
    torch.testing.assert_close(output(_load(out), kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="merges a LoRA-only checkpoint") as caught:
        _convert(src, tmp_path / "full", base=src)  # full weights with a base
    assert "holds model weights" in str(caught.value)


# ---------------------------------------------------------------------------------------------- Wan2.2 A14B experts
def _expert(seed, in_channels=36):
    """A tiny Wan2.2 I2V-A14B expert: 16 latent + 20 condition channels in, no image embedder."""
    return _model(seed=seed, in_channels=in_channels)


def _assert_experts(out, high, low):
    for subfolder, source in (("transformer", high), ("transformer_2", low)):
        converted = _load(out, subfolder)
        assert (converted.config.in_channels, converted.config.image_dim) == (36, None)
        _assert_same_outputs(converted, source)


def test_fastvideo_a14b_diffusers_experts_are_validated_and_resharded(tmp_path):
    high, low = _expert(20), _expert(21)
    src = write_diffusers_experts(tmp_path / "CausalWan2.2-I2V-A14B-Preview-Diffusers", high, low)
    out = tmp_path / "out"
    assert main([src, str(out), "--num-attention-heads", str(HEADS), "--max-shard-size", "20KB"]) == 0
    _assert_experts(out, high, low)
    index = json.loads((out / "transformer_2" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # re-sharded
    sampling = CausalConfig.load(out)
    assert sampling == FORMATS["fastvideo_a14b"].sampling and sampling.source == "fastvideo_a14b"


def test_original_wan22_experts(tmp_path):
    high, low = _expert(22), _expert(23)
    src = write_original_experts(tmp_path / "Wan2.2-I2V-A14B", high, low)
    out = _convert(src, tmp_path / "out")
    _assert_experts(out, high, low)
    assert CausalConfig.load(out).source == "wan22_a14b"


def test_fp8_scaled_experts_are_dequantized(tmp_path):
    """ComfyUI's scaled-fp8 expert files: each weight is its fp8 value times its scale, to 1e-5 in float32; without
    dtype the dequantized weights are written in bfloat16."""
    (tmp_path / "experts").mkdir()
    references = []
    for seed, name in ((24, "high_noise_model"), (25, "low_noise_model")):
        state, dequantized = fp8_scaled_state(_expert(seed))
        save_file(state, tmp_path / "experts" / f"{name}.safetensors")
        reference = _expert(seed)
        reference.load_state_dict(dequantized, strict=False)
        references.append(reference)
    out = _convert(tmp_path / "experts", tmp_path / "out", dtype="float32")
    kwargs = inputs(references[0])
    for subfolder, reference in zip(("transformer", "transformer_2"), references):
        torch.testing.assert_close(output(_load(out, subfolder), kwargs), output(reference, kwargs), atol=1e-5,
                                   rtol=1e-5)

    out = pathlib.Path(_convert(tmp_path / "experts", tmp_path / "bf16"))
    with safe_open(out / "transformer" / "diffusion_pytorch_model.safetensors", framework="pt") as f:
        assert f.get_slice("blocks.0.attn1.to_q.weight").get_dtype() == "BF16"


def test_expert_loras_merge_onto_the_two_expert_base(tmp_path):
    high, low = _expert(26), _expert(27)
    base = write_diffusers_experts(tmp_path / "Wan2.2-I2V-A14B-Diffusers", high, low)
    references = []
    for seed, name in ((26, "high_noise_model"), (27, "low_noise_model")):
        reference = _expert(seed)
        add_random_lora(reference, rank=4, alpha=4.0, seed=seed)
        lora_state_file(tmp_path / "loras" / f"{name}.safetensors", reference)
        references.append(reference)
    with pytest.raises(ValueError, match="holds only LoRA weights") as caught:
        _convert(tmp_path / "loras", tmp_path / "refused")
    assert "high_noise_model.safetensors" in str(caught.value)
    assert not os.path.exists(tmp_path / "refused")

    out = _convert(tmp_path / "loras", tmp_path / "out", base=base)
    kwargs = inputs(high)
    for subfolder, reference in zip(("transformer", "transformer_2"), references):
        torch.testing.assert_close(output(_load(out, subfolder), kwargs), output(reference, kwargs), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_a_missing_expert_is_named(tmp_path, layout):
    src = tmp_path / "experts"
    if layout == "original":
        write_safetensors_shards(src / "high_noise_model", original_state_dict(_expert(28)))
        missing = "low_noise_model"
    else:
        _expert(28).save_pretrained(src / "transformer_2")
        write_model_index(src)
        missing = "transformer/"
    with pytest.raises(ValueError, match="a Wan2.2 A14B checkpoint holds two experts") as caught:
        _convert(src, tmp_path / "out")
    assert missing in str(caught.value)
    assert not os.path.exists(tmp_path / "out")


def test_a_one_model_pipeline_folder_is_not_two_experts(tmp_path):
    _expert(29).save_pretrained(tmp_path / "pipeline" / "transformer")
    write_model_index(tmp_path / "pipeline", second_expert=False)
    with pytest.raises(ValueError, match="holds no transformer weights"):
        _convert(tmp_path / "pipeline", tmp_path / "out")


def test_experts_of_an_unknown_layout(tmp_path):
    for name in ("transformer", "transformer_2"):
        (tmp_path / "src" / name).mkdir(parents=True)
        save_file({"encoder.conv1.weight": torch.zeros(1)}, tmp_path / "src" / name / "vae.safetensors")
    with pytest.raises(ValueError, match="not a Wan checkpoint layout the converter knows") as caught:
        _convert(tmp_path / "src", tmp_path / "out")
    assert "vae.safetensors" in str(caught.value) and "from_pretrained" not in str(caught.value)


def test_experts_of_two_models_are_refused(tmp_path):
    src = write_diffusers_experts(tmp_path / "src", _expert(30), _expert(31, in_channels=16))
    with pytest.raises(ValueError, match="experts do not share one config") as caught:
        _convert(src, tmp_path / "out")
    assert "in_channels: 36 vs 16" in str(caught.value)
    assert not os.path.exists(tmp_path / "out")


def test_packed_quantized_weights_are_refused(tmp_path):
    state = original_state_dict(_model())
    state["blocks.0.self_attn.q.weight"] = torch.zeros(24, 12, dtype=torch.uint8)
    src = tmp_path / "model_4o6.safetensors"
    save_file(state, src)
    with pytest.raises(ValueError, match="the converter cannot dequantize") as caught:
        _convert(src, tmp_path / "out")
    assert "blocks.0.self_attn.q.weight (torch.uint8)" in str(caught.value)


# ---------------------------------------------------------------------------------------------- all or nothing (#26)
def _tree(folder) -> dict[str, bytes] | None:
    """Every file under ``folder`` with its bytes (``None`` when it does not exist): what "as it was" means."""
    folder = pathlib.Path(folder)
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent) -> list[str]:
    """Staged or moved-aside folders of a conversion left in ``parent``."""
    return [p.name for p in pathlib.Path(parent).iterdir() if ".converting-" in p.name or ".replaced-" in p.name]


class _FailingWrites:
    """Counts the files written under ``root`` (opened for writing, or saved by safetensors) and raises ``OSError``
    (no space left) on the ``fail_at``-th: a disk that fills part-way."""

    def __init__(self, root, fail_at=None):
        self.root, self.fail_at, self.count = str(root), fail_at, 0
        self._open, self._save_file = builtins.open, safetensors.torch.save_file

    def _written(self, path):
        if not os.path.abspath(os.fspath(path)).startswith(self.root):
            return
        self.count += 1
        if self.count == self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", os.fspath(path))

    def open(self, file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(m in mode for m in "wxa+"):
            self._written(file)
        return self._open(file, mode, *args, **kwargs)

    def save_file(self, tensors, filename, *args, **kwargs):
        self._written(filename)
        return self._save_file(tensors, filename, *args, **kwargs)

    def __enter__(self):
        self._patches = [mock.patch("builtins.open", self.open),
                         mock.patch("safetensors.torch.save_file", self.save_file)]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self._patches):
            patch.stop()


def _assert_all_or_nothing(convert, out):
    """``convert(out)`` with a write failing on the k-th file, for every k: each leaves ``out`` exactly as it was
    (files and bytes, or absent) and nothing beside it; then, unhindered, it completes."""
    parent = pathlib.Path(out).parent
    while not parent.exists():
        parent = parent.parent
    with _FailingWrites(parent) as counting:
        convert(parent / "count" / "out")
    assert counting.count >= 4, counting.count
    before, folders = _tree(out), [p for p in pathlib.Path(out).parents if p.exists()]
    for k in range(1, counting.count + 1):
        with pytest.raises(OSError, match="injected"), _FailingWrites(parent, fail_at=k):
            convert(out)
        assert _tree(out) == before, f"a failure on write {k} of {counting.count} changed OUT"
        assert [p for p in pathlib.Path(out).parents if p.exists()] == folders  # parents made for it: removed
        assert _leftovers(folders[0]) == [], k
    convert(out)
    return counting.count


def test_a_failing_write_over_an_earlier_conversion_leaves_it_whole(tmp_path):
    """The issue's case: a disk that fills on the k-th of 6 shards, over an earlier conversion, for every k; the old
    folder keeps loading as the old model, and nothing is left beside it."""
    old, new = _model(seed=0), _model(seed=1)
    out = tmp_path / "converted" / "model"
    _convert(write_wrapper(tmp_path / "a" / "self_forcing_dmd.pt", old), out, max_shard_size="20KB")
    src = write_wrapper(tmp_path / "b" / "self_forcing_dmd.pt", new)
    shards = len(list(out.glob("*.safetensors")))
    assert shards == 6
    files = _assert_all_or_nothing(lambda o: _convert(src, o, max_shard_size="20KB", overwrite=True), out)
    assert files == shards + 4  # the shards, their index, config.json, causal_config.json, README.md
    _assert_same_outputs(_load(out), new)


def test_a_failing_write_into_a_new_folder_leaves_nothing(tmp_path):
    """Into an OUT that does not exist, whose parents do not either: a failure removes the parents it made."""
    src = write_wrapper(tmp_path / "src" / "self_forcing_dmd.pt", _model())
    _assert_all_or_nothing(lambda o: _convert(src, o), tmp_path / "new" / "deeper" / "out")


def test_a_failing_write_of_the_second_expert_leaves_both_experts_old(tmp_path):
    old = write_diffusers_experts(tmp_path / "old" / "experts", _expert(1), _expert(2))
    new_high, new_low = _expert(3), _expert(4)
    new = write_diffusers_experts(tmp_path / "new" / "experts", new_high, new_low)
    out = tmp_path / "out"
    _convert(old, out)
    _assert_all_or_nothing(lambda o: _convert(new, o, overwrite=True, max_shard_size="20KB"), out)
    _assert_experts(out, new_high, new_low)


def test_a_failing_write_of_a_lora_adapter_leaves_the_folder_whole(longlive, tmp_path):
    base, reference, src, lora = longlive
    out = tmp_path / "out"
    _convert(src, out, lora=lora, lora_alpha=8.0)
    _assert_all_or_nothing(lambda o: _convert(src, o, lora=lora, lora_mode="adapter", lora_alpha=8.0,
                                              overwrite=True), out)
    assert (out / LORA_WEIGHT_NAME).is_file()


def test_a_failing_check_or_move_leaves_out_as_it_was(tmp_path):
    """After every file is written: a model that does not load back as planned, or a rename that fails while the
    old OUT is moved aside, leave OUT as it was (put back) and nothing beside it."""
    src = write_wrapper(tmp_path / "src" / "self_forcing_dmd.pt", _model(seed=1))
    out = tmp_path / "out"
    _convert(write_wrapper(tmp_path / "old" / "self_forcing_dmd.pt", _model(seed=0)), out)
    before = _tree(out)

    real = WanTransformer3DModel.from_pretrained

    def missing_a_key(*args, **kwargs):
        model, info = real(*args, **kwargs)
        return model, {**info, "missing_keys": ["proj_out.weight"]}

    with mock.patch.object(WanTransformer3DModel, "from_pretrained", missing_a_key), \
            pytest.raises(RuntimeError, match="failed its check after writing"):
        _convert(src, out, overwrite=True)
    assert _tree(out) == before and _leftovers(tmp_path) == []

    renames = []

    def second_rename_fails(a, b):
        renames.append((a, b))
        if len(renames) == 2:  # OUT is moved aside; the new folder's move into place fails
            raise OSError(errno.EXDEV, "injected")
        return os_rename(a, b)

    os_rename = os.rename
    with mock.patch("os.rename", second_rename_fails), pytest.raises(OSError, match="injected"):
        _convert(src, out, overwrite=True)
    assert len(renames) == 3 and _tree(out) == before and _leftovers(tmp_path) == []  # the third put OUT back


def test_overwrite_replaces_out_whole(longlive, tmp_path):
    """The issue's cases: a plain conversion after an adapter one leaves no LoRA file behind, and a single-file
    conversion after a sharded one no stale index; without overwrite both are refused, OUT untouched."""
    base, reference, src, lora = longlive
    out = tmp_path / "out"
    _convert(src, out, lora=lora, lora_mode="adapter", max_shard_size="20KB")
    before = _tree(out)
    assert LORA_WEIGHT_NAME in before and "diffusion_pytorch_model.safetensors.index.json" in before
    with pytest.raises(ValueError, match="already exists and is not empty") as caught:
        _convert(src, out, lora=lora)
    assert "--overwrite" in str(caught.value) and _tree(out) == before

    _convert(src, out, lora=lora, lora_alpha=8.0, overwrite=True)
    assert sorted(_tree(out)) == ["README.md", "causal_config.json", "config.json",
                                  "diffusion_pytorch_model.safetensors"]
    kwargs = inputs(base)
    torch.testing.assert_close(output(_load(out), kwargs), output(reference, kwargs), atol=1e-5, rtol=1e-5)


def test_an_empty_out_folder_is_filled_without_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    model = _model()
    _assert_same_outputs(_load(_convert(write_wrapper(tmp_path / "self_forcing_dmd.pt", model), tmp_path / "out")),
                         model)


@pytest.mark.parametrize("where", ["out-is-src-folder", "out-inside-src-folder", "out-holds-src-file", "out-is-lora",
                                   "out-holds-base", "through-a-link"])
def test_out_never_where_the_conversion_reads(tmp_path, where):
    """The issue's case: OUT == SRC overwrote the source shards (a failure part-way destroyed them)."""
    source = tmp_path / "Wan2.1"
    write_safetensors_shards(source, original_state_dict(_model()), shards=2)
    wrapper = write_wrapper(tmp_path / "ckpt" / "longlive_base.pt", _model())
    lora = longlive_lora_file(tmp_path / "ckpt" / "lora.pt", _lora_reference())
    (tmp_path / "link").symlink_to(source)
    src, out, kwargs = {
        "out-is-src-folder": (source, source, {"overwrite": True}),
        "out-inside-src-folder": (source, source / "converted", {}),
        "out-holds-src-file": (wrapper, tmp_path, {"overwrite": True}),
        "out-is-lora": (wrapper, lora, {"lora": lora, "overwrite": True}),
        "out-holds-base": (lora, tmp_path / "ckpt", {"base": wrapper, "overwrite": True}),
        "through-a-link": (tmp_path / "link", source / "out", {}),
    }[where]
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="the converter never writes where it reads") as caught:
        _convert(src, out, **kwargs)
    assert str(out) in str(caught.value)
    assert _tree(tmp_path) == before


def _lora_reference():
    reference = _model(seed=6)
    add_random_lora(reference, rank=4, alpha=8.0)
    return reference


@pytest.mark.parametrize("name", ["../elsewhere/{}", "{absolute}", "sub/../../elsewhere/{}"])
def test_an_index_naming_shards_outside_its_folder_is_refused(tmp_path, name):
    index = pathlib.Path(write_safetensors_shards(tmp_path / "elsewhere", original_state_dict(_model()), shards=2))
    shards = json.loads(index.read_text())
    shards["weight_map"] = {key: name.format(file, absolute=tmp_path / "elsewhere" / file)
                            for key, file in shards["weight_map"].items()}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / index.name).write_text(json.dumps(shards))
    with pytest.raises(ValueError, match="names a shard outside its folder"):
        _convert(tmp_path / "model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_index_naming_shards_in_a_subfolder_of_its_own_is_read(tmp_path):
    model = _model(seed=8)
    index = pathlib.Path(write_safetensors_shards(tmp_path / "model" / "shards", original_state_dict(model)))
    shards = json.loads(index.read_text())
    shards["weight_map"] = {key: f"shards/{file}" for key, file in shards["weight_map"].items()}
    (tmp_path / "model" / index.name).write_text(json.dumps(shards))
    _assert_same_outputs(_load(_convert(tmp_path / "model" / index.name, tmp_path / "out")), model)


# ---------------------------------------------------------------------------------------------- the 2026 releases (#31)
@pytest.mark.parametrize("path, peer", [
    # TencentARC/RollingForcing's release: inference.py --use_ema strips `_fsdp_wrapped_module.` from generator_ema
    ("checkpoints/rolling_forcing_dmd.pt", "rolling_forcing"),
    # thu-ml/Causal-Forcing's Causal-Forcing++ releases (zhuhz22/Causal-Forcing causal-forcing++/...), run --use_ema
    ("causal-forcing++/framewise-2step.pt", "causal_forcing_pp_2step"),
    ("causal-forcing++/framewise-1step.pt", "causal_forcing_pp_1step"),
])
def test_the_newer_releases_convert_their_ema_weights_with_their_sampling(tmp_path, path, peer):
    generator, ema = _model(seed=0), _model(seed=1)
    src = write_wrapper(tmp_path / path, generator, ema, inner="_fsdp_wrapped_module.")
    out = _convert(src, tmp_path / "out")
    _assert_same_outputs(_load(out), ema)
    config = CausalConfig.load(out)
    assert config == FORMATS[peer].sampling and config.source == peer


def test_rolling_forcing_and_causal_forcing_pp_sampling_settings():
    rolling = FORMATS["rolling_forcing"].sampling
    assert (rolling.sampler, rolling.chunk_frames, rolling.timesteps) == ("rolling_forcing", 3,
                                                                          (1000.0, 800.0, 600.0, 400.0, 200.0))
    assert (rolling.window_frames, rolling.sink_frames, rolling.positions) == (21, 3, "relative")
    for peer, steps in (("causal_forcing_pp_2step", (1000.0, 500.0)), ("causal_forcing_pp_1step", (1000.0,))):
        config = FORMATS[peer].sampling
        assert (config.chunk_frames, config.timesteps, config.first_chunk_timesteps) == (
            1, steps, (1000.0, 750.0, 500.0, 250.0))


@pytest.mark.parametrize("path, format, needs", [
    ("Reward-Forcing/rewardforcing.pt", "auto", "an EMA sink"),
    ("anywhere/model.pt", "reward_forcing", "an EMA sink"),
    ("ckpts/wan_causal_dmd_v2v/model.pt", "auto", "a KV cache written by the denoising passes of noisy chunks"),
    ("anywhere/model.pt", "streamdiffusionv2", "a KV cache written by the denoising passes of noisy chunks"),
    ("anywhere/model.pt", "memflow", "a memory bank"),
])
def test_releases_needing_a_mechanism_the_package_lacks_are_refused_by_name(tmp_path, path, format, needs):
    src = write_wrapper(tmp_path / path, _model())
    out = tmp_path / "out"
    with pytest.raises(NotImplementedError, match="cannot be converted") as caught:
        _convert(src, out, format=format)
    assert needs in str(caught.value) and not out.exists()


# ---------------------------------------------------------------------------------------------- --format auto (#26)
@pytest.mark.parametrize("path, peer, reason", [
    # the cases: the file's own name before its folder's
    ("self_forcing_runs/causvid_autoregressive.pt", "causvid", "its name 'causvid_autoregressive.pt' has 'causvid'"),
    ("self-forcing-baselines/longlive_base.pt", "longlive", "its name 'longlive_base.pt' has 'longlive'"),
    ("krea/self_forcing_dmd.pt", "self_forcing", "its name 'self_forcing_dmd.pt' has 'self_forcing'"),
    # a file name that names nothing: its folder's
    ("autoregressive_checkpoint/model.pt", "causvid",
     "its folder's name 'autoregressive_checkpoint' has 'autoregressive_checkpoint'"),
])
def test_auto_format_goes_by_the_files_own_name_first(tmp_path, capsys, path, peer, reason):
    src = write_wrapper(tmp_path / path, _model())
    out = tmp_path / "out"
    assert main([src, str(out), "--num-attention-heads", str(HEADS)]) == 0
    assert CausalConfig.load(out) == FORMATS[peer].sampling
    assert f"format {peer}: {reason}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the model card (#26)
def test_a_converted_folder_is_a_hub_model_repo_with_its_card(tmp_path):
    """README.md with the front matter the Hub reads, the sources, format and reason, the settings, and a command
    that makes the same folder again."""
    from huggingface_hub import ModelCard

    model = _model(seed=9)
    src = write_wrapper(tmp_path / "checkpoints" / "self_forcing_dmd.pt", model, _model(seed=10))
    out = _convert(src, tmp_path / "out", ema=False, dtype="bfloat16", causal_config={"chunk_frames": [1, 4, 4]})
    card = ModelCard.load(pathlib.Path(out) / "README.md")  # a local file: parsed, nothing fetched
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-video"
    assert {"diffusers-causal-kv", "wan", "self-forcing"} <= set(card.data.tags)
    assert card.data.base_model is None  # a tiny model is no Wan release: nothing invented
    assert f"`{src}['generator']`" in card.text and "`self_forcing` (Self-Forcing): its name" in card.text
    assert '| `chunk_frames` | `[1, 4, 4]` |' in card.text and '| `shift` | `5.0` |' in card.text

    command = next(line for line in card.text.splitlines() if line.startswith("python -m diffusers_causal_kv.convert"))
    argv = shlex.split(command)[3:]
    assert argv[:2] == [src, str(tmp_path / "out")] and "--no-ema" in argv and "--dtype" in argv
    argv[1] = str(tmp_path / "again")
    assert main(argv) == 0
    again = _tree(tmp_path / "again")
    again["README.md"] = again["README.md"].replace(argv[1].encode(), str(out).encode())
    assert again == _tree(out)  # the same weights, settings and card


def test_the_card_of_two_experts_and_of_an_image_to_video_model(tmp_path):
    from huggingface_hub import ModelCard

    src = write_diffusers_experts(tmp_path / "CausalWan2.2-I2V-A14B-Preview-Diffusers", _expert(1), _expert(2))
    card = ModelCard.load(pathlib.Path(_convert(src, tmp_path / "out")) / "README.md")
    assert card.data.pipeline_tag == "image-to-video" and "fastvideo-a14b" in card.data.tags
    assert 'subfolder="transformer"' in card.text and "transformer_2" in card.text
    assert "CausalWan2.2-I2V-A14B-Preview-Diffusers/transformer" in card.text


@pytest.mark.parametrize("experts, config, release", [
    (1, dict(num_layers=30, heads=12, ffn_dim=8960, in_channels=16, out_channels=16), "Wan2.1-T2V-1.3B"),
    (1, dict(num_layers=40, heads=40, ffn_dim=13824, in_channels=16, out_channels=16), "Wan2.1-T2V-14B"),
    (1, dict(num_layers=30, heads=24, ffn_dim=14336, in_channels=48, out_channels=48), "Wan2.2-TI2V-5B"),
    (2, dict(num_layers=40, heads=40, ffn_dim=13824, in_channels=36, out_channels=16), "Wan2.2-I2V-A14B"),
    (1, dict(num_layers=40, heads=40, ffn_dim=13824, in_channels=36, out_channels=16, image_dim=1280), None),
    (1, dict(num_layers=29, heads=12, ffn_dim=8960, in_channels=16, out_channels=16), None),
], ids=["t2v-1.3b", "t2v-14b", "ti2v-5b", "i2v-a14b", "i2v-14b-480p-or-720p", "no-release"])
def test_base_model_is_the_wan_release_of_that_architecture_or_none(experts, config, release):
    from diffusers_causal_kv.convert.card import base_model

    heads = config.pop("heads")
    config = {"attention_head_dim": 128, "num_attention_heads": heads, "image_dim": None, **config}
    found = base_model({f"transformer{i}": config for i in range(experts)})
    assert found == (None if release is None else f"Wan-AI/{release}-Diffusers")
