"""diffusers' own contract for pipelines and Modular pipelines, checked on ``CausalWanPipeline`` and on the causal
Modular blocks (``causal_wan_blocks()``).

diffusers' Wan pipeline tests (``tests/pipelines/wan/test_wan.py``, with the checks every pipeline inherits: saving
and loading, variants, dtypes and devices, batches, callbacks, ``from_pipe``, offloading) and its Modular Pipelines
Wan tests are not in the wheel. These are the same contract checks written for the causal pipeline, one test per
contract. Every check of a generated video runs twice: with one chunk (``chunk_frames`` covers the 3 latent frames:
one pass through the cache, as a bidirectional pipeline would run) and with ``chunk_frames=1`` (three chunks through
the cache); the checks that run once use three chunks. Left out: comparisons with a bidirectional model's hard-coded
numbers. Run here on the CPU, where diffusers runs them on an accelerator only: offloading (onload and offload device
both the CPU), float16 and bfloat16 inference, layerwise casting.

The inputs are diffusers' dummy inputs for Wan: a prompt and a negative prompt, 9 frames of 16 x 16 (3 latent frames of
2 x 2), two steps of the pipeline's scheduler per chunk, guidance 6, generators on the CPU. Lists of generators follow
the stock semantics: sample ``i`` draws its noise from generator ``i``, so a batch equals the single calls, sample by
sample.
"""

from __future__ import annotations

import inspect
import json
import os
import types

import pytest
import torch
from diffusers import ModularPipeline, WanPipeline
from diffusers.hooks import apply_group_offloading
from diffusers.modular_pipelines.wan import encoders as modular_wan_encoders
from diffusers.utils import is_ftfy_available
from helpers import tiny_wan

from diffusers_causal_kv import (
    CausalWanAttnProcessor,
    CausalWanPipeline,
    causal_rollout,
    causal_wan_blocks,
)
from diffusers_causal_kv.modular import CausalWanBlocks, CausalWanCoreDenoiseStep
from diffusers_causal_kv.testing import tiny_conditioning, tiny_pipeline_components

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = 9, 16, 16  # video frames and pixels: 3 latent frames of 2 x 2
LATENT_FRAMES = 3
PROMPT = "dance monkey"
THREE_CHUNKS = 1  # chunk_frames of the checks that run once: every chunk after the first reads the cache
OFFLOADING = {
    "block_level": dict(offload_type="block_level", num_blocks_per_group=1),
    "leaf_level": dict(offload_type="leaf_level"),
}


@pytest.fixture(scope="module", params=[LATENT_FRAMES, 1], ids=["one-chunk", "three-chunks"])
def chunk_frames(request) -> int:
    return request.param


def _pipeline(**components) -> CausalWanPipeline:
    """The pipeline under test, from the tiny components (the package's tiny text encoder and tokenizer included)."""
    pipe = CausalWanPipeline(**(components or tiny_pipeline_components()))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _inputs(chunk_frames: int, seed: int = 0, **overrides) -> dict:
    inputs = dict(prompt=PROMPT, negative_prompt="negative", generator=torch.Generator(CPU).manual_seed(seed),
                  num_inference_steps=2, guidance_scale=6.0, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                  max_sequence_length=16, chunk_frames=chunk_frames, output_type="pt")
    inputs.update(overrides)
    return inputs


def _video(pipe, chunk_frames: int, **overrides) -> torch.Tensor:
    return pipe(**_inputs(chunk_frames, **overrides))[0]


@pytest.fixture(scope="module")
def reference(chunk_frames) -> torch.Tensor:
    """The video of a freshly built pipeline on the dummy inputs (computed once per chunking)."""
    return _video(_pipeline(), chunk_frames)


def _assert_same_video(video, expected, atol=0.0):
    """Bitwise by default; ``atol`` where the weights were reloaded (the same values in other memory can take another
    CPU kernel path: last-bit differences)."""
    torch.testing.assert_close(video, expected, rtol=0, atol=atol)


def _batched_prompts(batch: int) -> list[str]:
    """diffusers' batch of prompts of unequal lengths, the last one longer than max_sequence_length."""
    return [PROMPT[: len(PROMPT) // i] for i in range(1, batch)] + [100 * "very long"]


def _generators(batch: int) -> list[torch.Generator]:
    return [torch.Generator(CPU).manual_seed(i) for i in range(batch)]


# ---------------------------------------------------------------------------------------------- call and output
def test_call_signature_takes_the_stock_wan_parameters():
    parameters = inspect.signature(CausalWanPipeline.__call__).parameters
    required = {"prompt", "negative_prompt", "height", "width", "guidance_scale", "prompt_embeds",
                "negative_prompt_embeds"}
    optional = {"num_inference_steps", "num_videos_per_prompt", "generator", "latents", "output_type", "return_dict",
                "callback_on_step_end", "callback_on_step_end_tensor_inputs"}
    assert required <= set(parameters)
    assert {name for name in optional
            if name not in parameters or parameters[name].default is inspect.Parameter.empty} == set()


def test_output_is_one_video_of_the_requested_shape_without_nans(reference):
    assert reference.shape == (1, FRAMES, 3, HEIGHT, WIDTH)
    assert not reference.isnan().any()


def test_dict_and_tuple_outputs_are_equal(chunk_frames):
    pipe = _pipeline()
    _assert_same_video(pipe(**_inputs(chunk_frames), return_dict=False)[0], pipe(**_inputs(chunk_frames)).frames)


def test_guidance_above_one_runs_guidance_in_the_same_shape():
    pipe = _pipeline()
    unguided = _video(pipe, THREE_CHUNKS, guidance_scale=1.0)
    guided = _video(pipe, THREE_CHUNKS, guidance_scale=7.5)
    assert guided.shape == unguided.shape and not torch.equal(guided, unguided)


def test_attention_slicing_changes_nothing(reference, chunk_frames):
    pipe = _pipeline()
    pipe.enable_attention_slicing()  # the Wan transformer has no sliced attention: accepted, as on WanPipeline
    _assert_same_video(_video(pipe, chunk_frames), reference)


# ---------------------------------------------------------------------------------------------- batches
def test_num_videos_per_prompt_multiplies_the_batch(chunk_frames):
    pipe = _pipeline()
    for batch, per_prompt in [(1, 2), (2, 1), (2, 2)]:
        prompt = PROMPT if batch == 1 else [PROMPT] * batch
        videos = _video(pipe, chunk_frames, prompt=prompt, num_videos_per_prompt=per_prompt, output_type="latent")
        assert videos.shape[0] == batch * per_prompt


def test_batched_prompts_with_a_generator_per_sample_give_one_video_each(chunk_frames):
    videos = _video(_pipeline(), chunk_frames, prompt=_batched_prompts(2), generator=_generators(2))
    assert len(videos) == 2


def test_batch_with_a_generator_per_sample_equals_the_single_calls(chunk_frames):
    pipe = _pipeline()
    prompts = _batched_prompts(3)
    batch = _video(pipe, chunk_frames, prompt=prompts, generator=_generators(3))
    assert batch.shape[0] == 3
    for i, prompt in enumerate(prompts):  # sample i: prompt i with generator i, alone
        _assert_same_video(batch[i:i + 1], _video(pipe, chunk_frames, prompt=prompt, seed=i), atol=1e-4)


# ---------------------------------------------------------------------------------------------- callbacks
def test_callback_receives_the_requested_tensors_only(chunk_frames):
    pipe = _pipeline()
    assert set(pipe._callback_tensor_inputs) >= {"latents", "prompt_embeds", "negative_prompt_embeds"}
    seen = []

    def callback(p, step, t, kwargs):
        seen.append(set(kwargs))
        return kwargs

    for requested in (["latents"], pipe._callback_tensor_inputs):
        seen.clear()
        _video(pipe, chunk_frames, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=requested,
               output_type="latent")
        assert seen == [set(requested)] * pipe.num_timesteps


def test_callback_latents_replace_the_chunk_being_denoised(chunk_frames):
    pipe = _pipeline()

    def zero_at_the_last_step(p, step, t, kwargs):
        if step == p.num_timesteps - 1:
            kwargs["latents"] = torch.zeros_like(kwargs["latents"])
        return kwargs

    latents = _video(pipe, chunk_frames, callback_on_step_end=zero_at_the_last_step,
                     callback_on_step_end_tensor_inputs=pipe._callback_tensor_inputs, output_type="latent")
    # The callback's latents are the chunk's: with one chunk the whole video (diffusers' check), else the last chunk.
    assert latents[:, :, -chunk_frames:].abs().sum() == 0
    if chunk_frames < LATENT_FRAMES:
        assert latents[:, :, :-chunk_frames].abs().sum() > 0


def test_callback_can_change_the_guidance_scale():
    pipe = _pipeline()

    def raise_guidance(p, step, t, kwargs):
        p._guidance_scale += 1.0
        return kwargs

    _video(pipe, THREE_CHUNKS, guidance_scale=2.0, callback_on_step_end=raise_guidance)
    assert pipe.guidance_scale == 2.0 + pipe.num_timesteps


# ---------------------------------------------------------------------------------------------- components
def test_components_are_the_init_arguments():
    components = tiny_pipeline_components()
    pipe = _pipeline(**components)
    assert set(pipe.components) == {"tokenizer", "text_encoder", "vae", "scheduler", "transformer", "image_encoder",
                                    "image_processor", "transformer_2"}
    assert all(pipe.components[name] is component for name, component in components.items())


def test_to_dtype_casts_every_component():
    pipe = _pipeline()
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert all(module.dtype == torch.float32 for module in modules.values())
    pipe.to(dtype=torch.float16)
    assert {name: module.dtype for name, module in modules.items()} == dict.fromkeys(modules, torch.float16)


def test_to_cpu_moves_every_component(chunk_frames, reference):
    pipe = _pipeline().to("cpu")
    assert all(c.device.type == "cpu" for c in pipe.components.values() if isinstance(c, torch.nn.Module))
    _assert_same_video(_video(pipe, chunk_frames), reference)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_runs_without_nans(dtype):
    videos = _video(_pipeline().to(dtype=dtype), THREE_CHUNKS)
    assert videos.dtype == dtype and not videos.isnan().any()


def test_encode_prompt_in_isolation_gives_the_same_video(reference, chunk_frames):
    components = tiny_pipeline_components()
    text_only = _pipeline(**{name: c if name in ("text_encoder", "tokenizer") else None
                             for name, c in components.items()})
    with torch.no_grad():
        positive, negative = text_only.encode_prompt(PROMPT, "negative", max_sequence_length=16, device=CPU)
    no_text = _pipeline(**{**components, "text_encoder": None, "tokenizer": None})
    video = _video(no_text, chunk_frames, prompt=None, negative_prompt=None, prompt_embeds=positive,
                   negative_prompt_embeds=negative)
    _assert_same_video(video, reference)


# ---------------------------------------------------------------------------------------------- save and load
def test_save_pretrained_and_from_pretrained_give_the_same_video(tmp_path, chunk_frames, reference):
    _pipeline().save_pretrained(tmp_path, safe_serialization=False)
    loaded = CausalWanPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    _assert_same_video(_video(loaded, chunk_frames), reference, atol=1e-5)


def test_optional_components_stay_none_after_save_and_load(tmp_path):
    pipe = _pipeline()
    assert all(getattr(pipe, name) is None for name in pipe._optional_components)
    expected = _video(pipe, THREE_CHUNKS)
    pipe.save_pretrained(tmp_path, safe_serialization=False)
    loaded = CausalWanPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert all(getattr(loaded, name) is None for name in pipe._optional_components)
    _assert_same_video(_video(loaded, THREE_CHUNKS), expected, atol=1e-5)


def test_save_with_a_variant_names_every_weight_file(tmp_path):
    pipe = _pipeline()
    pipe.save_pretrained(tmp_path, variant="fp16", safe_serialization=False)
    index = json.loads((tmp_path / "model_index.json").read_text())
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert name in index
            assert any(file.split(".")[1].startswith("fp16") for file in os.listdir(tmp_path / name)), name


def test_load_with_a_variant_gives_the_same_weights(tmp_path):
    pipe = _pipeline()
    pipe.save_pretrained(tmp_path, variant="fp16", safe_serialization=False)
    loaded = CausalWanPipeline.from_pretrained(tmp_path, variant="fp16")
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            reloaded = dict(loaded.components[name].named_parameters())
            assert all(torch.equal(p, reloaded[k]) for k, p in component.named_parameters() if k in reloaded), name


def test_load_with_a_missing_variant_raises(tmp_path):
    _pipeline().save_pretrained(tmp_path, safe_serialization=False)
    with pytest.raises(ValueError, match="You are trying to load the model files of the `variant=fp16`"):
        CausalWanPipeline.from_pretrained(tmp_path, variant="fp16")


def test_torch_dtype_dict_sets_each_component_dtype(tmp_path):
    pipe = _pipeline()
    pipe.save_pretrained(tmp_path, safe_serialization=False)
    first = next(iter(pipe.components))
    dtypes = {first: torch.bfloat16, "default": torch.float16}
    loaded = CausalWanPipeline.from_pretrained(tmp_path, torch_dtype=dtypes)
    for name, component in loaded.components.items():
        if isinstance(component, torch.nn.Module):
            assert component.dtype == dtypes.get(name, dtypes["default"]), name


def test_device_map_loading_gives_the_same_video(tmp_path, reference, chunk_frames):
    _pipeline().save_pretrained(tmp_path)
    loaded = CausalWanPipeline.from_pretrained(tmp_path, device_map="cpu")
    loaded.set_progress_bar_config(disable=True)
    _assert_same_video(_video(loaded, chunk_frames), reference, atol=1e-5)


# ---------------------------------------------------------------------------------------------- from_pipe
def _stock_inputs(chunk_frames: int) -> dict:
    inputs = _inputs(chunk_frames)
    del inputs["chunk_frames"]
    return inputs


def test_from_pipe_of_the_stock_pipeline_gives_the_same_video_and_leaves_it_unchanged(chunk_frames, reference):
    stock = WanPipeline(**tiny_pipeline_components())
    stock.set_progress_bar_config(disable=True)
    stock_video = stock(**_stock_inputs(chunk_frames))[0]
    pipe = CausalWanPipeline.from_pipe(stock)
    pipe.set_progress_bar_config(disable=True)
    assert all(pipe.components[name] is component for name, component in stock.components.items()
               if name in pipe.components)
    _assert_same_video(_video(pipe, chunk_frames), reference)
    # The causal processors now installed on the shared transformer compute the stock attention outside a context.
    _assert_same_video(stock(**_stock_inputs(chunk_frames))[0], stock_video)


def test_from_pipe_back_and_forth_keeps_the_stock_config():
    stock = WanPipeline(**tiny_pipeline_components())
    back = WanPipeline.from_pipe(CausalWanPipeline.from_pipe(stock))
    assert _public(back.config) == _public(stock.config)


def _public(config) -> dict:
    return {key: value for key, value in config.items() if not key.startswith("_")}


# ---------------------------------------------------------------------------------------------- offloading
def test_model_cpu_offload_gives_the_same_video(chunk_frames, reference):
    import accelerate

    pipe = _pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    assert pipe._execution_device.type == "cpu"
    _assert_same_video(_video(pipe, chunk_frames), reference)
    offloaded = {name: c for name, c in pipe.components.items()
                 if isinstance(c, torch.nn.Module) and name not in pipe._exclude_from_cpu_offload}
    assert all(c.device.type == "cpu" and isinstance(c._hf_hook, accelerate.hooks.CpuOffload)
               for c in offloaded.values())


def test_model_cpu_offload_enabled_twice_gives_the_same_video():
    pipe = _pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    first = _video(pipe, THREE_CHUNKS)
    pipe.enable_model_cpu_offload(device="cpu")
    _assert_same_video(_video(pipe, THREE_CHUNKS), first)


def _stock_sequential_offload_failure() -> str | None:
    """Why ``enable_sequential_cpu_offload`` fails on the stock ``WanPipeline`` here, if it does: the causal pipeline
    cannot be asked to do better. (accelerate 1.16 with torch 2.13 on the CPU fails moving a weight back to the meta
    device after its first forward, a ``torch.Tensor`` where it expects a ``Parameter``.)"""
    stock = WanPipeline(**tiny_pipeline_components())
    stock.set_progress_bar_config(disable=True)
    stock.enable_sequential_cpu_offload(device="cpu")
    try:
        stock(**_stock_inputs(LATENT_FRAMES))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def test_sequential_cpu_offload_gives_the_same_video(chunk_frames, reference):
    failure = _stock_sequential_offload_failure()
    if failure is not None:
        pytest.skip(f"enable_sequential_cpu_offload fails on the stock WanPipeline here: {failure.splitlines()[0]}")
    pipe = _pipeline()
    pipe.enable_sequential_cpu_offload(device="cpu")
    _assert_same_video(_video(pipe, chunk_frames), reference)
    offloaded = [c for name, c in pipe.components.items()
                 if isinstance(c, torch.nn.Module) and name not in pipe._exclude_from_cpu_offload]
    assert all(c.device.type == "meta" and hasattr(c, "_hf_hook") for c in offloaded)


def _offload_components(pipe, offload: dict) -> None:
    """diffusers' component-level group offloading: the text encoder and the transformer offloaded, the VAE not."""
    pipe.transformer.enable_group_offload(CPU, offload_device=CPU, **offload)
    apply_group_offloading(pipe.text_encoder, onload_device=CPU, offload_device=CPU, **offload)


@pytest.mark.parametrize("offload", sorted(OFFLOADING))
@pytest.mark.parametrize("order", ["before_the_first_call", "after_the_first_call"])
def test_group_offloading_of_the_components_gives_the_same_video(offload, order):
    expected = _video(_pipeline(), THREE_CHUNKS)
    pipe = _pipeline()
    if order == "after_the_first_call":  # the first call installs the causal processors and their hooks
        _video(pipe, THREE_CHUNKS)
    _offload_components(pipe, OFFLOADING[offload])
    _assert_same_video(_video(pipe, THREE_CHUNKS), expected)


def test_pipeline_level_group_offloading_gives_the_same_video(chunk_frames, reference):
    # Not to disk: diffusers names a leaf group's file by the module's name within its component, so the components of
    # one pipeline overwrite each other's files (the stock WanPipeline's video is wrong too).
    pipe = _pipeline()
    pipe.enable_group_offload(onload_device=CPU, offload_device=CPU, offload_type="leaf_level")
    _assert_same_video(_video(pipe, chunk_frames), reference)


def _rollout(model):
    noise = torch.randn(2, 16, LATENT_FRAMES, 4, 4, generator=torch.Generator().manual_seed(0))
    text, _ = tiny_conditioning(model)
    return causal_rollout(model, noise, text, chunk_frames=1, timesteps=[1000, 500],
                          generator=torch.Generator().manual_seed(1), progress=False).latents


@pytest.mark.parametrize("offload", ["block_level", "leaf_level", "leaf_level_to_disk"])
@pytest.mark.parametrize("order", ["before_installing", "after_the_first_rollout"])
def test_group_offloading_keeps_the_causal_rollout_bitwise(offload, order, tmp_path):
    """Either order of enable_group_offload and the processors' installation: leaf-level offloading hooks
    transformer.rope, and its onloading must wrap the plugin's RoPE hook (emptied buffers on disk tell the order)."""
    plain = tiny_wan()
    plain.set_attn_processor(CausalWanAttnProcessor())
    expected = _rollout(plain)
    config = dict(OFFLOADING[offload.removesuffix("_to_disk")])
    if offload.endswith("_to_disk"):
        config["offload_to_disk_path"] = str(tmp_path)
    model = tiny_wan()
    if order == "after_the_first_rollout":
        model.set_attn_processor(CausalWanAttnProcessor())
        _rollout(model)
    model.enable_group_offload(CPU, offload_device=CPU, **config)
    model.set_attn_processor(CausalWanAttnProcessor())
    assert torch.equal(_rollout(model), expected)


def test_layerwise_casting_runs_without_nans():
    pipe = _pipeline().to(dtype=torch.bfloat16)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert not _video(pipe, THREE_CHUNKS).isnan().any()


# ---------------------------------------------------------------------------------------------- Modular pipelines
@pytest.fixture(scope="module", autouse=True)
def modular_text_encoder_without_ftfy():
    """The stock modular text encoder step calls ``ftfy.fix_text`` even when ftfy is not installed (the stock
    pipelines skip it then); an identity stands in for it, so the step runs the tiny text encoder."""
    with pytest.MonkeyPatch.context() as patch:
        if not is_ftfy_available():
            patch.setattr(modular_wan_encoders, "ftfy", types.SimpleNamespace(fix_text=lambda text: text),
                          raising=False)
        yield


def _modular(**components) -> ModularPipeline:
    """The causal Wan blocks' pipeline with the tiny components (its guider: the blocks' default, guidance 5)."""
    pipe = causal_wan_blocks().init_pipeline()
    pipe.update_components(**(components or tiny_pipeline_components()))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _modular_inputs(chunk_frames: int, seed: int = 0, **overrides) -> dict:
    inputs = _inputs(chunk_frames, seed, **overrides)
    for name in ("negative_prompt", "guidance_scale"):  # the guider's, with its default negative prompt
        inputs.pop(name)
    return inputs


def _modular_video(pipe, chunk_frames: int, **overrides) -> torch.Tensor:
    return pipe(**_modular_inputs(chunk_frames, **overrides), output="videos")


@pytest.fixture(scope="module")
def modular_reference(chunk_frames, modular_text_encoder_without_ftfy) -> torch.Tensor:
    return _modular_video(_modular(), chunk_frames)


def test_modular_blocks_take_the_stock_wan_inputs():
    pipe = _modular()
    assert {"prompt", "height", "width", "num_frames", "chunk_frames"} <= set(pipe.blocks.input_names)
    assert {"num_inference_steps", "num_videos_per_prompt", "latents"} <= set(pipe.default_call_parameters)


def test_modular_output_is_one_video_without_nans(modular_reference):
    assert modular_reference.shape == (1, FRAMES, 3, HEIGHT, WIDTH)
    assert not modular_reference.isnan().any()


def test_modular_blocks_equal_the_causal_pipeline(chunk_frames):
    """The same causal sampling through both front ends (the pipeline's guidance without batching the two tags, as
    the guider runs one forward per tag), from the same initial noise."""
    noise = torch.randn(1, 16, LATENT_FRAMES, 2, 2, generator=torch.Generator().manual_seed(5))
    modular = _modular_video(_modular(), chunk_frames, latents=noise)
    pipeline = _video(_pipeline(), chunk_frames, latents=noise, guidance_scale=5.0, negative_prompt=None,
                      cfg_batch=False)
    _assert_same_video(modular, pipeline, atol=1e-5)


def test_modular_num_videos_per_prompt_multiplies_the_batch(chunk_frames):
    pipe = _modular()
    for batch, per_prompt in [(1, 2), (2, 2)]:
        prompt = PROMPT if batch == 1 else [PROMPT] * batch
        latents = pipe(**_modular_inputs(chunk_frames, prompt=prompt, num_videos_per_prompt=per_prompt),
                       output="latents")
        assert latents.shape[0] == batch * per_prompt


def test_modular_batch_with_a_generator_per_sample_equals_the_single_calls(chunk_frames, modular_reference):
    pipe = _modular()
    batch = _modular_video(pipe, chunk_frames, prompt=[PROMPT, PROMPT], generator=_generators(2))
    assert batch.shape[0] == 2
    _assert_same_video(batch[:1], modular_reference, atol=1e-4)
    _assert_same_video(batch[1:], _modular_video(pipe, chunk_frames, seed=1), atol=1e-4)


def _save_modular(pipe, folder) -> None:
    """diffusers' custom-blocks flow: the pipeline saves its components and index, the blocks their class."""
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    pipe.blocks.save_pretrained(str(folder))


def test_modular_save_pretrained_round_trip_keeps_the_causal_blocks(tmp_path, chunk_frames, modular_reference):
    _save_modular(_modular(), tmp_path)
    loaded = ModularPipeline.from_pretrained(tmp_path, trust_remote_code=True)
    assert isinstance(loaded.blocks, CausalWanBlocks)
    assert isinstance(loaded.blocks.sub_blocks["denoise"], CausalWanCoreDenoiseStep)
    loaded.load_components(torch_dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    _assert_same_video(_modular_video(loaded, chunk_frames), modular_reference, atol=1e-5)


def test_modular_saved_folder_names_the_causal_blocks(tmp_path):
    pipe = _modular()
    _save_modular(pipe, tmp_path)
    index = json.loads((tmp_path / "modular_model_index.json").read_text())
    assert {"_blocks_class_name", "_class_name", "_diffusers_version"} <= set(index)
    assert index["_blocks_class_name"] == "CausalWanBlocks"
    auto_map = json.loads((tmp_path / "modular_config.json").read_text())["auto_map"]
    module, name = auto_map["ModularPipelineBlocks"].split(".")
    assert name == "CausalWanBlocks" and (tmp_path / f"{module}.py").is_file()
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(".")]  # no staging folder left
    # The saved components are the ones a reload loads.
    loaded = ModularPipeline.from_pretrained(tmp_path, trust_remote_code=True)
    loaded.load_components(torch_dtype=torch.float32)
    saved = {name for name, value in index.items() if isinstance(value, list) and (tmp_path / name).is_dir()}
    assert saved == {name for name, c in loaded.components.items()
                     if getattr(c, "_diffusers_load_id", None) not in (None, "null")}
    with pytest.raises(ValueError, match="trust_remote_code=True"):  # custom code is never run unasked
        ModularPipeline.from_pretrained(tmp_path)
