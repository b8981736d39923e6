"""Causal denoise blocks for diffusers' Modular Pipelines (Wan2.1 T2V and I2V; Wan2.2 T2V, I2V and VACE).

The stock ``WanBlocks`` and ``WanImage2VideoAutoBlocks`` (and the Wan2.2 sets ``Wan22Blocks``,
``Wan22Image2VideoBlocks``, ``Wan22VaceBlocks``) denoise the whole video at once: their core denoise step
(``sub_blocks["denoise"]``) sets the scheduler's timesteps once, prepares the latents of every frame and loops over
the timesteps with every frame in each forward. The causal core steps here replace that whole core step. They keep
the stock input steps (prompt batching, I2V condition latents) and the stock ``WanPrepareLatentsStep`` (the noise of
every frame), drop ``WanSetTimestepsStep``, and replace the timestep loop by one block that loops over chunks of
latent frames, runs every denoising step of a chunk against the KV cache of the chunks before it, then commits the
clean chunk to the cache. The stock inner loop (``WanDenoiseLoopWrapper``) cannot be kept: its denoiser runs the
guider's conditional and unconditional batches back to back in one loop step, with no seam to give each its own cache
tag, and the scheduler must be reset for every chunk rather than set once for the video.

The guider's batches map to the cache tags of classifier-free guidance: ``"pred_cond"`` runs on tag ``"pos"`` with
``prompt_embeds``, ``"pred_uncond"`` on tag ``"neg"`` with ``negative_prompt_embeds``; the guider combines their flows
as it does in the stock loop, and its step counter restarts with every chunk (each chunk is a whole denoising
trajectory, so ``start``/``stop`` windows apply per chunk). Every chunk is committed on every tag the guider uses at
any step, so the ``"neg"`` cache stays continuous even where a window skips guidance. Guiders with other batches, or
that change the model for a batch (perturbed-attention, skip-layer, smoothed-energy, auto guidance), are refused: a
perturbed forward would attend to a prefix cached without the perturbation.

Saving: :func:`causal_wan_blocks` turns the stock sets into block sets of their own classes (:class:`CausalWanBlocks`,
:class:`CausalWanImage2VideoAutoBlocks`, :class:`CausalWan22Blocks`, :class:`CausalWan22Image2VideoBlocks`,
:class:`CausalWan22VaceBlocks`), which diffusers loads as custom blocks: a pipeline saved with
``pipe.save_pretrained(folder)`` and ``pipe.blocks.save_pretrained(folder)`` reloads with the causal steps through
``ModularPipeline.from_pretrained(folder, trust_remote_code=True)``.

Wan2.2 (two experts): the denoise step of a Wan2.2 set runs ``transformer`` with ``guider`` at timesteps
``t >= boundary_ratio * 1000`` (the pipeline config's ``boundary_ratio``) and ``transformer_2`` with ``guider_2`` below,
choosing on the timestep passed to the transformer, as the stock ``Wan22LoopDenoiser`` does; every chunk is committed
in both experts' caches (each with its own weights), both or neither. Without a ``transformer_2`` component the one
``transformer`` runs every step with ``guider``. The VACE set's encoder step downsamples the control mask causally
(:func:`~diffusers_causal_kv.pipelines.inputs.causal_vace_mask`, as ``CausalWanPipeline`` does), so a chunk's control
latents depend on its own frames and the ones before only.

The forwards, chunk schedule, pre-flight checks and commits are :class:`~diffusers_causal_kv.RolloutPlanner`'s and the
chunk loop is :func:`~diffusers_causal_kv.rollout.rollout_chunks`, as in :func:`~diffusers_causal_kv.causal_rollout`,
so the blocks give the rollout's latents exactly (random numbers are drawn in the same order).
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Sequence
from types import MappingProxyType

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.guiders import BaseGuidance, ClassifierFreeGuidance
from diffusers.models import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.modular_pipelines import ModularPipelineBlocks, PipelineState, SequentialPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, ConfigSpec, InputParam, OutputParam
from diffusers.modular_pipelines.wan.before_denoise import (
    WanAdditionalInputsStep,
    WanPrepareLatentsStep,
    WanTextInputStep,
    WanVaceAdditionalInputsStep,
)
from diffusers.modular_pipelines.wan.decoders import WanVaceTrimReferenceLatentsStep
from diffusers.modular_pipelines.wan.encoders import WanVaceEncoderStep
from diffusers.modular_pipelines.wan.modular_blocks_wan import WanBlocks, WanCoreDenoiseStep
from diffusers.modular_pipelines.wan.modular_blocks_wan22 import Wan22Blocks, Wan22CoreDenoiseStep
from diffusers.modular_pipelines.wan.modular_blocks_wan22_i2v import (
    Wan22Image2VideoBlocks,
    Wan22Image2VideoCoreDenoiseStep,
)
from diffusers.modular_pipelines.wan.modular_blocks_wan_i2v import (
    WanImage2VideoAutoBlocks,
    WanImage2VideoCoreDenoiseStep,
)
from diffusers.modular_pipelines.wan.modular_blocks_wan_vace import Wan22VaceBlocks, Wan22VaceCoreDenoiseStep
from diffusers.schedulers import UniPCMultistepScheduler

from .masks import chunk_schedule
from .model import topology
from .pipelines.inputs import causal_vace_mask
from .pipelines.loading import install_causal_processors
from .planner import Chunk, RolloutPlanner, check_context_noise
from .session import RolloutSession, Sampling, shifted_sigmas

__all__ = [
    "GUIDER_CACHE_TAGS",
    "CausalWan22Blocks",
    "CausalWan22CoreDenoiseStep",
    "CausalWan22DenoiseStep",
    "CausalWan22Image2VideoBlocks",
    "CausalWan22Image2VideoCoreDenoiseStep",
    "CausalWan22Image2VideoDenoiseStep",
    "CausalWan22VaceBlocks",
    "CausalWan22VaceCoreDenoiseStep",
    "CausalWan22VaceDenoiseStep",
    "CausalWanBlocks",
    "CausalWanCoreDenoiseStep",
    "CausalWanDenoiseStep",
    "CausalWanImage2VideoAutoBlocks",
    "CausalWanImage2VideoCoreDenoiseStep",
    "CausalWanImage2VideoDenoiseStep",
    "CausalWanVaceEncoderStep",
    "causal_wan22_blocks",
    "causal_wan22_i2v_blocks",
    "causal_wan22_vace_blocks",
    "causal_wan_blocks",
    "causal_wan_i2v_blocks",
]

GUIDER_CACHE_TAGS = {"pred_cond": "pos", "pred_uncond": "neg"}
"""The cache tag each guider batch runs on, by the batch's ``__guidance_identifier__``."""

DEFAULT_TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)


class _Experts:
    """The transformers a denoise step runs, as the planner reads a pipeline's: ``transformer`` and, for Wan2.2 A14B,
    ``transformer_2``."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module | None) -> None:
        self.transformer, self.transformer_2 = transformer, transformer_2


class _GuidedPlanner(RolloutPlanner):
    """A :class:`RolloutPlanner` whose flow is the guider's combination of one forward per guider batch, each on the
    batch's cache tag; with two experts, each expert's own guider (``guiders`` in the order of the experts). Local
    adapter until the planner takes its tags and its guidance from the caller."""

    def __init__(self, model, prompt_embeds: torch.Tensor, guiders: list, guider_state, guider_fields: dict,
                 num_steps: int, **kwargs) -> None:
        super().__init__(model, prompt_embeds, **kwargs)
        self.guiders, self.guider_state, self.guider_fields = guiders, guider_state, guider_fields
        self.num_steps = num_steps
        self._chunk, self._step = None, 0

    def guider_for(self, t):
        """The guider of the expert that denoises at timestep ``t``."""
        return self.guiders[0] if self.expert_for(t) is self.experts[0] else self.guiders[1]

    def flow(self, x: torch.Tensor, t, chunk: Chunk) -> torch.Tensor:
        if chunk != self._chunk:  # every chunk is a whole trajectory: the guider's steps restart
            self._chunk, self._step = chunk, 0
        expert, guider = self.expert_for(t), self.guider_for(t)
        batches = _guider_batches(guider, self.guider_state, self.guider_fields, self._step, self.num_steps, t)
        self._step += 1
        for batch in batches:
            guider.prepare_models(expert.transformer)
            batch.noise_pred = self.forward(x, t, chunk, GUIDER_CACHE_TAGS[batch.__guidance_identifier__],
                                            expert=expert)
            guider.cleanup_models(expert.transformer)
        # In the latents' dtype, as the stock loop's noise_pred.float(): a flow-matching scheduler step casts its
        # result to the flow's dtype.
        return guider(batches)[0].to(x.dtype)


def _guider_batches(guider, state, fields: dict, step: int, num_steps: int, t) -> list:
    guider.set_state(step=step, num_inference_steps=num_steps, timestep=t)
    return guider.prepare_inputs_from_block_state(state, fields)


class CausalWanDenoiseStep(ModularPipelineBlocks):
    """Causal, chunk-by-chunk denoising of Wan2.1 T2V latents with the KV cache (replaces the stock
    ``WanSetTimestepsStep`` and ``WanDenoiseStep``).

    For each chunk of ``chunk_frames`` latent frames: denoise it against the cached chunks before it, either
    few-step (``timesteps`` and ``shift``, Self-Forcing style; the default) or with the pipeline's ``scheduler`` reset
    for the chunk (``num_inference_steps`` per chunk); then commit the clean chunk with the timestep label
    ``context_noise`` (re-noised to it with ``context_noise_mode="renoise"``) on every cache tag. The transformer
    gets ``CausalWanAttnProcessor`` installed if it runs the stock processors.
    """

    model_name = "wan"
    _guider_fields = {"encoder_hidden_states": ("prompt_embeds", "negative_prompt_embeds")}
    _transformer_class = WanTransformer3DModel

    @property
    def description(self) -> str:
        return ("Causal denoise step: denoises the latents chunk by chunk of latent frames against the KV cache of "
                "the chunks before, committing each clean chunk (diffusers_causal_kv).")

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [
            ComponentSpec("guider", ClassifierFreeGuidance, config=FrozenDict({"guidance_scale": 5.0}),
                          default_creation_method="from_config"),
            ComponentSpec("transformer", self._transformer_class),
            ComponentSpec("scheduler", UniPCMultistepScheduler),
        ]

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam("latents", required=True, type_hint=torch.Tensor,
                       description="The noise of every latent frame. Can be generated in prepare_latents step."),
            InputParam("prompt_embeds", required=True, type_hint=torch.Tensor,
                       description="Text embeddings of the cache tag 'pos'."),
            InputParam("negative_prompt_embeds", type_hint=torch.Tensor,
                       description="Text embeddings of the cache tag 'neg', for the guider's unconditional batch."),
            InputParam("attention_kwargs"),
            InputParam("chunk_frames", default=3, type_hint=int | list[int],
                       description="Latent frames per chunk (the first chunk absorbs a remainder), or a list of "
                                   "chunk sizes adding up to the latent frames."),
            InputParam("timesteps", type_hint=list[float],
                       description=f"Few-step timesteps per chunk, in (0, 1000]; default {list(DEFAULT_TIMESTEPS)}. "
                                   "Not with num_inference_steps."),
            InputParam("shift", default=5.0, type_hint=float,
                       description="Timestep shift of the few-step timesteps (Self-Forcing's warp)."),
            InputParam("num_inference_steps", type_hint=int,
                       description="Steps per chunk with the pipeline's scheduler instead of few-step sampling."),
            InputParam("context_noise", default=0.0, type_hint=float,
                       description="Timestep label (0..1000) of the commit pass of each clean chunk."),
            InputParam("context_noise_mode", default="label", type_hint=str,
                       description="'label' commits the clean chunk with that label; 'renoise' first noises it to "
                                   "that level (the same at context_noise=0)."),
            InputParam("cache_engines", type_hint=dict,
                       description="Engine map of this rollout (one per user session); default "
                                   "transformer.kv_cache_engines."),
            InputParam("generator", description="Random generator of the re-noising between few-step steps."),
        ]

    @property
    def intermediate_outputs(self) -> list[OutputParam]:
        return [OutputParam("latents", type_hint=torch.Tensor, description="Denoised latents.")]

    def per_frame_inputs(self, block_state) -> dict:
        """The planner's per-frame and image inputs (none for T2V)."""
        return {}

    def experts(self, components) -> tuple[_Experts, list, dict]:
        """``(transformers, their guiders, planner arguments)``: the one ``transformer`` with ``guider`` here."""
        return _Experts(_transformer(components, vace=False), None), [components.guider], {}

    @torch.no_grad()
    def __call__(self, components, state: PipelineState) -> tuple:
        block_state = self.get_block_state(state)
        scheduler, sigmas, step_timesteps = _sampling(components, block_state, block_state.latents.device)
        experts, guiders, expert_args = self.experts(components)
        planner = _GuidedPlanner(
            experts, block_state.prompt_embeds, guiders, block_state, self._guider_fields, len(step_timesteps),
            attention_kwargs=block_state.attention_kwargs, cache_engines=block_state.cache_engines,
            generator=block_state.generator, **expert_args, **self.per_frame_inputs(block_state),
        )
        # the tags the guiders use, not the planner's own guidance_scale rule
        planner.prompts = MappingProxyType(_guided_prompts(planner, block_state, self._guider_fields, step_timesteps))
        check_context_noise(block_state.context_noise, block_state.context_noise_mode)
        for expert in planner.experts:
            install_causal_processors(expert.transformer)
        latents = block_state.latents
        sampling = Sampling(None if sigmas is None else tuple(sigmas), scheduler, block_state.num_inference_steps,
                            block_state.context_noise, block_state.context_noise_mode)
        session = RolloutSession(planner, sampling, sizes=chunk_schedule(latents.shape[2], block_state.chunk_frames),
                                 latent_shape=(*latents.shape[:2], *latents.shape[3:]), device=latents.device,
                                 latents=latents)
        block_state.latents = torch.cat([made.latents for made in session], dim=2)
        self.set_block_state(state, block_state)
        return components, state


def _condition_latents_input() -> InputParam:
    """The I2V condition input of the Wan2.1 and Wan2.2 image-to-video denoise steps."""
    return InputParam("image_condition_latents", required=True, type_hint=torch.Tensor,
                      description="Mask and image latents of every frame, [batch, 20, frames, height, width]. Can "
                                  "be generated in the vae_encoder step.")


class CausalWanImage2VideoDenoiseStep(CausalWanDenoiseStep):
    """:class:`CausalWanDenoiseStep` for Wan2.1 I2V: each chunk's latents are concatenated with the chunk's frames of
    ``image_condition_latents`` (mask and first-frame latents) and every forward gets ``image_embeds``."""

    model_name = "wan-i2v"
    _guider_fields = {**CausalWanDenoiseStep._guider_fields, "encoder_hidden_states_image": "image_embeds"}

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *super().inputs,
            _condition_latents_input(),
            InputParam("image_embeds", required=True, type_hint=torch.Tensor,
                       description="Image-encoder embeddings. Can be generated in the image_encoder step."),
        ]

    def per_frame_inputs(self, block_state) -> dict:
        return {"condition_latents": block_state.image_condition_latents, "image_embeds": block_state.image_embeds}


class _TwoExpertSteps:
    """The Wan2.2 part of a denoise step: ``transformer`` and ``guider`` above the boundary timestep,
    ``transformer_2`` and ``guider_2`` below it, and the pipeline config's ``boundary_ratio``."""

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [
            *super().expected_components,
            ComponentSpec("guider_2", ClassifierFreeGuidance, config=FrozenDict({"guidance_scale": 3.0}),
                          default_creation_method="from_config"),
            ComponentSpec("transformer_2", self._transformer_class),
        ]

    @property
    def expected_configs(self) -> list[ConfigSpec]:
        return [ConfigSpec(name="boundary_ratio", default=0.875,
                           description="Timestep fraction where transformer_2 (with guider_2) takes over from "
                                       "transformer (with guider), chosen on the timestep passed.")]

    def experts(self, components) -> tuple[_Experts, list, dict]:
        transformer = _transformer(components, vace=self._transformer_class is WanVACETransformer3DModel)
        second = getattr(components, "transformer_2", None)
        if second is None:  # one expert (e.g. Wan2.2 TI2V-5B, or a Wan2.1 VACE model in the VACE set)
            return _Experts(transformer, None), [components.guider], {}
        guider_2 = getattr(components, "guider_2", None) or components.guider
        return (_Experts(transformer, second), [components.guider, guider_2],
                {"boundary_ratio": components.config.boundary_ratio})


class CausalWan22DenoiseStep(_TwoExpertSteps, CausalWanDenoiseStep):
    """:class:`CausalWanDenoiseStep` for Wan2.2 (replaces the stock ``WanSetTimestepsStep`` and
    ``Wan22DenoiseStep``): ``transformer`` with ``guider`` at timesteps ``t >= boundary_ratio * 1000``,
    ``transformer_2`` with ``guider_2`` below, every chunk committed in both experts' caches."""


class CausalWan22Image2VideoDenoiseStep(_TwoExpertSteps, CausalWanDenoiseStep):
    """:class:`CausalWan22DenoiseStep` for Wan2.2 I2V-A14B: each chunk's latents are concatenated with the chunk's
    frames of ``image_condition_latents`` (mask and first-frame latents); no image embeddings."""

    model_name = "wan-i2v"

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *super().inputs,
            _condition_latents_input(),
        ]

    def per_frame_inputs(self, block_state) -> dict:
        return {"condition_latents": block_state.image_condition_latents}


class CausalWan22VaceDenoiseStep(_TwoExpertSteps, CausalWanDenoiseStep):
    """:class:`CausalWan22DenoiseStep` for VACE (``WanVACETransformer3DModel`` experts, or one): each chunk's forwards
    get the chunk's frames of ``control_hidden_states`` and the per-layer ``control_hidden_states_scale``."""

    model_name = "wan-vace"
    _transformer_class = WanVACETransformer3DModel

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *super().inputs,
            InputParam("control_hidden_states", required=True, type_hint=torch.Tensor,
                       description="VACE control latents of every frame (video latents and causal mask). Can be "
                                   "generated in the vace_encoder step."),
            InputParam("control_hidden_states_scale", required=True, type_hint=torch.Tensor,
                       description="Scale of each VACE layer. Can be generated in the vace_encoder step."),
        ]

    def per_frame_inputs(self, block_state) -> dict:
        dtype = block_state.latents.dtype if block_state.control_hidden_states.is_floating_point() else None
        return {"control_latents": block_state.control_hidden_states.to(dtype),
                "control_scale": block_state.control_hidden_states_scale}


class CausalWanVaceEncoderStep(WanVaceEncoderStep):
    """The stock ``WanVaceEncoderStep`` with the control mask downsampled in time causally (latent frame ``j`` takes
    the mask of video frame ``4j``), as ``CausalWanPipeline`` does, instead of resampled over the whole video."""

    @staticmethod
    def prepare_masks(components, mask, reference_images):
        if any(len(images) for images in reference_images):
            raise ValueError("reference_images are not supported by the causal VACE path yet; drop them (they would "
                             "have to be prefilled before frame 0).")
        return torch.cat([causal_vace_mask(m[None], True, components.vae_scale_factor_spatial) for m in mask])


class CausalWanCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``WanCoreDenoiseStep`` (``WanBlocks.sub_blocks["denoise"]``): the stock input and
    prepare-latents steps, then :class:`CausalWanDenoiseStep`."""

    model_name = "wan"
    block_classes = [WanTextInputStep, WanPrepareLatentsStep, CausalWanDenoiseStep]
    block_names = ["input", "prepare_latents", "denoise"]

    @property
    def description(self):
        return "Causal denoise block: takes encoded conditions and denoises the video chunk by chunk with a KV cache."

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


class CausalWanImage2VideoCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``WanImage2VideoCoreDenoiseStep`` (``WanImage2VideoAutoBlocks.sub_blocks["denoise"]``):
    the stock input steps (text, image condition latents) and prepare-latents step, then
    :class:`CausalWanImage2VideoDenoiseStep`."""

    model_name = "wan-i2v"
    block_classes = [
        WanTextInputStep,
        WanAdditionalInputsStep(image_latent_inputs=["image_condition_latents"]),
        WanPrepareLatentsStep,
        CausalWanImage2VideoDenoiseStep,
    ]
    block_names = ["input", "additional_inputs", "prepare_latents", "denoise"]

    @property
    def description(self):
        return ("Causal denoise block: takes encoded text and image latent conditions and denoises the video chunk "
                "by chunk with a KV cache.")


class CausalWan22CoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``Wan22CoreDenoiseStep`` (``Wan22Blocks.sub_blocks["denoise"]``): the stock input and
    prepare-latents steps, then :class:`CausalWan22DenoiseStep`."""

    model_name = "wan"
    block_classes = [WanTextInputStep, WanPrepareLatentsStep, CausalWan22DenoiseStep]
    block_names = ["input", "prepare_latents", "denoise"]

    @property
    def description(self):
        return ("Causal denoise block (Wan2.2, two experts): takes encoded conditions and denoises the video chunk by "
                "chunk with a KV cache per expert.")

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


class CausalWan22Image2VideoCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``Wan22Image2VideoCoreDenoiseStep`` (``Wan22Image2VideoBlocks.sub_blocks["denoise"]``):
    the stock input steps and prepare-latents step, then :class:`CausalWan22Image2VideoDenoiseStep`."""

    model_name = "wan-i2v"
    block_classes = [
        WanTextInputStep,
        WanAdditionalInputsStep(image_latent_inputs=["image_condition_latents"]),
        WanPrepareLatentsStep,
        CausalWan22Image2VideoDenoiseStep,
    ]
    block_names = ["input", "additional_inputs", "prepare_latents", "denoise"]

    @property
    def description(self):
        return ("Causal denoise block (Wan2.2 I2V, two experts): takes encoded text and image latent conditions and "
                "denoises the video chunk by chunk with a KV cache per expert.")

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


class CausalWan22VaceCoreDenoiseStep(SequentialPipelineBlocks):
    """Causal replacement of ``Wan22VaceCoreDenoiseStep`` (``Wan22VaceBlocks.sub_blocks["denoise"]``): the stock input,
    VACE input and prepare-latents steps, :class:`CausalWan22VaceDenoiseStep`, then the stock reference trim step."""

    model_name = "wan-vace"
    block_classes = [
        WanTextInputStep,
        WanVaceAdditionalInputsStep,
        WanPrepareLatentsStep,
        CausalWan22VaceDenoiseStep,
        WanVaceTrimReferenceLatentsStep,
    ]
    block_names = ["input", "additional_inputs", "prepare_latents", "denoise", "trim_latents"]

    @property
    def description(self):
        return ("Causal denoise block (Wan2.2 VACE): takes encoded text and VACE control latents and denoises the "
                "video chunk by chunk with a KV cache per expert.")

    @property
    def outputs(self):
        return [OutputParam.template("latents")]


_CAUSAL_CORE_STEPS = {
    WanCoreDenoiseStep: CausalWanCoreDenoiseStep,
    WanImage2VideoCoreDenoiseStep: CausalWanImage2VideoCoreDenoiseStep,
    Wan22CoreDenoiseStep: CausalWan22CoreDenoiseStep,
    Wan22Image2VideoCoreDenoiseStep: CausalWan22Image2VideoCoreDenoiseStep,
    Wan22VaceCoreDenoiseStep: CausalWan22VaceCoreDenoiseStep,
}


# How a saved folder finds these classes again. ModularPipeline.save_pretrained writes the components and
# modular_model_index.json, whose "_blocks_class_name" ModularPipeline.from_pretrained looks up in the diffusers
# namespace only, falling back silently to the stock set (WanBlocks...) for a name it does not find. Block sets
# diffusers does not ship load as custom code instead, the mechanism diffusers supports for them: the block set's own
# save_pretrained writes modular_config.json, whose "auto_map" names a module file in the folder and a class in it,
# and ModularPipeline.from_pretrained(folder, trust_remote_code=True) imports that class
# (ModularPipelineBlocks.from_pretrained) and builds the pipeline from it. diffusers leaves writing the module file to
# the author; ours writes it, as one import of the class from the installed package (no code is copied, so the folder
# always runs the installed version, which the causal step needs anyway). Registering the classes in the diffusers
# namespace instead would patch diffusers, and would work only in a process that imported this package first.
_BLOCKS_MODULE_NAME = "causal_wan_blocks"
_BLOCKS_MODULE = '''"""The causal Wan blocks of diffusers-causal-kv (pip install diffusers-causal-kv): load this
folder with ModularPipeline.from_pretrained(folder, trust_remote_code=True)."""

from {module} import {name}  # noqa: F401
'''


class _CausalBlockSet(SequentialPipelineBlocks):
    """A stock Wan block set with the causal steps in place of its stock ones (see :func:`causal_wan_blocks`), saved
    so that ``ModularPipeline.from_pretrained(folder, trust_remote_code=True)`` rebuilds it (not the stock set)."""

    @classmethod
    def _causal_steps(cls, stock: type[SequentialPipelineBlocks]) -> list:
        """The stock set's ``block_classes`` with the causal core denoise step (and VACE encoder step)."""
        causal = {**_CAUSAL_CORE_STEPS, WanVaceEncoderStep: CausalWanVaceEncoderStep}
        return [causal.get(block, block) for block in stock.block_classes]

    @property
    def description(self) -> str:
        return (f"{super().description} Causal: the core denoise step denoises the video chunk by chunk of latent "
                "frames with a KV cache (diffusers_causal_kv).")

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """Write ``modular_config.json`` (diffusers' ``auto_map`` to this class) and the module file it names into
        ``save_directory`` (created if missing), each replaced whole.

        Save a pipeline with ``pipe.save_pretrained(folder)`` (the components and ``modular_model_index.json``) and
        ``pipe.blocks.save_pretrained(folder)`` (this), then load it with
        ``ModularPipeline.from_pretrained(folder, trust_remote_code=True)``. ``push_to_hub`` and ``kwargs`` as in
        diffusers' ``ModularPipelineBlocks.save_pretrained``.
        """
        # diffusers' own save_pretrained keys auto_map by the class that defines the method it runs (this override,
        # here), where from_pretrained looks for "ModularPipelineBlocks": the entry is written here instead.
        entry = f"{_BLOCKS_MODULE_NAME}.{type(self).__name__}"
        self.register_to_config(auto_map={ModularPipelineBlocks.__name__: entry})
        os.makedirs(save_directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=save_directory, prefix=".causal_blocks_") as staging:
            self.save_config(staging)
            with open(os.path.join(staging, f"{_BLOCKS_MODULE_NAME}.py"), "w") as f:
                f.write(_BLOCKS_MODULE.format(module=type(self).__module__, name=type(self).__name__))
            for name in (self.config_name, f"{_BLOCKS_MODULE_NAME}.py"):
                os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
        if push_to_hub:  # the folder is complete: diffusers uploads it with the config
            self.save_config(save_directory, push_to_hub=True, **kwargs)


class CausalWanBlocks(_CausalBlockSet, WanBlocks):
    """``WanBlocks`` (Wan2.1 T2V) with :class:`CausalWanCoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(WanBlocks)


class CausalWanImage2VideoAutoBlocks(_CausalBlockSet, WanImage2VideoAutoBlocks):
    """``WanImage2VideoAutoBlocks`` (Wan2.1 I2V and FLF2V) with :class:`CausalWanImage2VideoCoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(WanImage2VideoAutoBlocks)


class CausalWan22Blocks(_CausalBlockSet, Wan22Blocks):
    """``Wan22Blocks`` (Wan2.2 T2V) with :class:`CausalWan22CoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(Wan22Blocks)


class CausalWan22Image2VideoBlocks(_CausalBlockSet, Wan22Image2VideoBlocks):
    """``Wan22Image2VideoBlocks`` (Wan2.2 I2V-A14B) with :class:`CausalWan22Image2VideoCoreDenoiseStep`."""

    block_classes = _CausalBlockSet._causal_steps(Wan22Image2VideoBlocks)


class CausalWan22VaceBlocks(_CausalBlockSet, Wan22VaceBlocks):
    """``Wan22VaceBlocks`` (VACE) with :class:`CausalWan22VaceCoreDenoiseStep` and :class:`CausalWanVaceEncoderStep`."""

    block_classes = _CausalBlockSet._causal_steps(Wan22VaceBlocks)


_CAUSAL_BLOCK_SETS = {
    WanBlocks: CausalWanBlocks,
    WanImage2VideoAutoBlocks: CausalWanImage2VideoAutoBlocks,
    Wan22Blocks: CausalWan22Blocks,
    Wan22Image2VideoBlocks: CausalWan22Image2VideoBlocks,
    Wan22VaceBlocks: CausalWan22VaceBlocks,
}


def causal_wan_blocks(blocks: SequentialPipelineBlocks | None = None) -> SequentialPipelineBlocks:
    """A copy of a Wan block set whose core denoise step (``sub_blocks["denoise"]``) is causal.

    Args:
        blocks: ``WanBlocks()`` (the default), ``WanImage2VideoAutoBlocks()``, ``Wan22Blocks()``,
            ``Wan22Image2VideoBlocks()`` or ``Wan22VaceBlocks()``, or a block set of your own whose ``"denoise"``
            sub-block is one of their stock core denoise steps; it is copied, not changed.

    Returns:
        The copy, with the causal core denoise step (:class:`CausalWanCoreDenoiseStep`,
        :class:`CausalWanImage2VideoCoreDenoiseStep`, :class:`CausalWan22CoreDenoiseStep`,
        :class:`CausalWan22Image2VideoCoreDenoiseStep` or :class:`CausalWan22VaceCoreDenoiseStep`) as its
        ``"denoise"`` sub-block; its other sub-blocks (text and image encoders, VAE decoder) are the stock ones, but
        for the VACE set's ``"vace_encoder"``, which becomes :class:`CausalWanVaceEncoderStep` (the causal mask).
        A stock set comes back as its causal subclass (:class:`CausalWanBlocks`,
        :class:`CausalWanImage2VideoAutoBlocks`, :class:`CausalWan22Blocks`,
        :class:`CausalWan22Image2VideoBlocks`, :class:`CausalWan22VaceBlocks`), whose ``save_pretrained`` makes
        a saved pipeline reload with the causal steps; like diffusers' own sets, it reloads with the class's
        sub-blocks, not with sub-blocks added or removed after it was built. A set of your own class stays of
        that class, which diffusers reloads by its name (with that class's own denoise step).
    """
    blocks = WanBlocks() if blocks is None else copy.deepcopy(blocks)
    core = blocks.sub_blocks.get("denoise")
    causal = _CAUSAL_CORE_STEPS.get(type(core))
    if causal is None:
        why = "has no 'denoise' sub-block" if core is None else f"has the denoise step {type(core).__name__}"
        raise NotImplementedError(
            f"{type(blocks).__name__} {why}, which the causal denoise blocks do not cover; they replace the stock "
            "core denoise steps of WanBlocks, WanImage2VideoAutoBlocks, Wan22Blocks, Wan22Image2VideoBlocks and "
            "Wan22VaceBlocks."
        )
    blocks.sub_blocks["denoise"] = causal()
    if isinstance(blocks.sub_blocks.get("vace_encoder"), WanVaceEncoderStep):
        blocks.sub_blocks["vace_encoder"] = CausalWanVaceEncoderStep()
    named = _CAUSAL_BLOCK_SETS.get(type(blocks))
    if named is None:
        return blocks
    made = named()
    made.sub_blocks = blocks.sub_blocks  # the given set's sub-blocks, as given (and made causal)
    return made


def causal_wan_i2v_blocks() -> CausalWanImage2VideoAutoBlocks:
    """``WanImage2VideoAutoBlocks()`` (Wan2.1 I2V and FLF2V) with the causal core denoise step."""
    return causal_wan_blocks(WanImage2VideoAutoBlocks())


def causal_wan22_blocks() -> CausalWan22Blocks:
    """``Wan22Blocks()`` (Wan2.2 T2V: A14B's two experts, or one transformer) with the causal core denoise step."""
    return causal_wan_blocks(Wan22Blocks())


def causal_wan22_i2v_blocks() -> CausalWan22Image2VideoBlocks:
    """``Wan22Image2VideoBlocks()`` (Wan2.2 I2V-A14B: condition latents, no image embeddings) with the causal core
    denoise step."""
    return causal_wan_blocks(Wan22Image2VideoBlocks())


def causal_wan22_vace_blocks() -> CausalWan22VaceBlocks:
    """``Wan22VaceBlocks()`` (VACE: two ``WanVACETransformer3DModel`` experts, or one) with the causal core denoise
    step and the causal control-mask encoder step."""
    return causal_wan_blocks(Wan22VaceBlocks())


def _transformer(components, vace: bool) -> torch.nn.Module:
    """The pipeline's transformer, checked for the denoise step (``vace``: a VACE step). The processors are installed
    once the step's inputs are checked (over the stock ones only: outside a ``CausalContext`` they compute exactly what
    the stock ones compute, so other pipelines sharing the transformer see no change)."""
    transformer = getattr(components, "transformer", None)
    if transformer is None:
        raise ValueError(
            "the causal denoise step needs a transformer component; load one with "
            "pipe.update_components(transformer=WanTransformer3DModel.from_pretrained(...)) or pipe.load_components()."
        )
    if topology(transformer).is_vace and not vace:
        raise NotImplementedError(
            f"the pipeline's transformer is a {type(transformer).__name__} (VACE control), which the causal denoise "
            "blocks do not cover outside the VACE block set; build the pipeline from causal_wan22_vace_blocks()."
        )
    return transformer


def _sampling(components, block_state, device) -> tuple:
    """``(scheduler, sigmas, timesteps of one chunk's steps)``: the pipeline's scheduler with ``num_inference_steps``,
    else few-step ``timesteps`` warped by ``shift``."""
    steps = block_state.num_inference_steps
    if steps is not None:
        if block_state.timesteps is not None:
            raise ValueError(
                f"pass either timesteps (few-step sampling) or num_inference_steps (the scheduler's steps per chunk), "
                f"not both; got timesteps={list(block_state.timesteps)} and num_inference_steps={steps}."
            )
        scheduler = getattr(components, "scheduler", None)
        if scheduler is None:
            raise ValueError(
                f"num_inference_steps={steps} samples with the pipeline's scheduler, but it has no scheduler "
                "component; pipe.update_components(scheduler=...), or drop num_inference_steps for few-step timesteps."
            )
        scheduler = copy.deepcopy(scheduler)  # the session's own: another run cannot reset it in between
        scheduler.set_timesteps(steps, device=device)
        return scheduler, None, list(scheduler.timesteps)
    sigmas = shifted_sigmas(DEFAULT_TIMESTEPS if block_state.timesteps is None else block_state.timesteps,
                            block_state.shift).tolist()
    return None, sigmas, [sigma * 1000 for sigma in sigmas]


def _guided_prompts(planner: _GuidedPlanner, block_state, fields: dict,
                    step_timesteps: Sequence) -> dict[str, torch.Tensor]:
    """The conditioning of each cache tag the guiders run at any step of a chunk (each step's guider: that of the
    step's expert), checked before any work."""
    used = []  # (guider, the identifiers of its batches) of every step
    for step, t in enumerate(step_timesteps):
        guider = planner.guider_for(t)
        batches = _guider_batches(guider, block_state, fields, step, len(step_timesteps), t)
        used.append((guider, {batch.__guidance_identifier__ for batch in batches}))
    for guider, identifiers in used:
        unknown = sorted(identifiers - set(GUIDER_CACHE_TAGS))
        perturbs = type(guider).prepare_models is not BaseGuidance.prepare_models
        if unknown or perturbs:
            why = ("changes the model for some of its batches (prepare_models)" if perturbs
                   else f"runs the batches {unknown}")
            raise NotImplementedError(
                f"{type(guider).__name__} {why}, and the causal denoise step caches only a guider's plain conditional "
                "and unconditional batches (cache tags 'pos' and 'neg'): a perturbed forward would attend to a prefix "
                "cached without the perturbation. Use ClassifierFreeGuidance or another guider of those two batches."
            )
    prompts = {GUIDER_CACHE_TAGS["pred_cond"]: block_state.prompt_embeds}
    guiding = [guider for guider, identifiers in used if "pred_uncond" in identifiers]
    if guiding:
        if block_state.negative_prompt_embeds is None:
            raise ValueError(
                f"the guider ({type(guiding[0]).__name__}) runs classifier-free guidance but negative_prompt_embeds is "
                "None; pass negative_prompt_embeds (or a negative_prompt through the text encoder step), or "
                "pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0)) for distilled models."
            )
        prompts[GUIDER_CACHE_TAGS["pred_uncond"]] = block_state.negative_prompt_embeds
    return prompts
