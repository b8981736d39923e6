"""The causal denoise steps of the Modular Pipelines blocks: one :class:`~diffusers_causal_kv.RolloutSession` per
run, over a planner whose flow is the guider's combination of one forward per guider batch (see the package
docstring)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import MappingProxyType

import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.guiders import BaseGuidance, ClassifierFreeGuidance
from diffusers.models import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.modular_pipelines import ModularPipelineBlocks, PipelineState
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, ConfigSpec, InputParam, OutputParam
from diffusers.schedulers import UniPCMultistepScheduler

from ..causal_config import DEFAULTS
from ..masks import chunk_schedule
from ..model import topology
from ..pipelines.loading import install_causal_processors
from ..planner import Chunk, RolloutPlanner, check_context_noise
from ..session import RolloutSession, Sampling, shifted_sigmas

GUIDER_CACHE_TAGS = {"pred_cond": "pos", "pred_uncond": "neg"}
"""The cache tag each guider batch runs on, by the batch's ``__guidance_identifier__``."""


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
                       description=f"Few-step timesteps per chunk, in (0, 1000]; default {list(DEFAULTS.timesteps)}. "
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
    sigmas = shifted_sigmas(DEFAULTS.timesteps if block_state.timesteps is None else block_state.timesteps,
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
