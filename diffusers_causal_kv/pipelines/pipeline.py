"""``CausalWanPipeline``: the diffusers pipeline of a causal Wan checkpoint, from a prompt to a video.

It is composed from the components of the stock Wan pipelines (tokenizer, UMT5 text encoder, ``AutoencoderKLWan``,
scheduler, a ``WanTransformer3DModel`` or ``WanVACETransformer3DModel``, and for Wan2.1 I2V the CLIP image encoder
and processor), so ``CausalWanPipeline.from_pipe(WanPipeline / WanImageToVideoPipeline / WanVACEPipeline)`` reuses
a loaded stock pipeline's objects as they are. Text, image and control inputs are prepared by the stock pipelines'
own methods (:mod:`.inputs`); each call is one :class:`~diffusers_causal_kv.RolloutSession`, with the checkpoint's
:class:`~diffusers_causal_kv.CausalConfig` (``causal_config.json``) as the defaults of every sampling argument.

Random numbers are drawn in one documented order, so a stream can reproduce a pipeline call: per chunk, in chunk
order, the chunk's initial noise ``randn_tensor([batch, channels, chunk_frames, h, w], generator)`` (unless
``latents`` are given), then one draw of the chunk's shape per re-noising between few-step steps, then the commit's
draw (``context_noise_mode="renoise"`` with ``context_noise > 0`` only). With a list of generators each sample draws
its own share from its own generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import (
    AutoencoderKLWan,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
)
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.loaders import WanLoraLoaderMixin
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.pipelines.wan.pipeline_wan_vace import WanVACEPipeline
from diffusers.utils import logging
from diffusers.utils.torch_utils import get_module_execution_device
from diffusers.video_processor import VideoProcessor
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

from ..causal_config import CausalConfig
from ..masks import chunk_schedule
from ..model import topology
from ..planner import RolloutPlanner
from ..rolling_forcing import make_session
from ..session import Sampling
from .inputs import call_inputs
from .loading import LoadingMixin
from .open_stream import StreamMixin

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class Guidance:
    """A call's or a stream's guidance scales (``scale_2``: Wan2.2 A14B's ``transformer_2``)."""

    scale: float
    scale_2: float | None

    @property
    def guided(self) -> bool:
        """Classifier-free guidance runs when a scale is above 1, as in the stock pipelines."""
        return self.scale > 1.0 or (self.scale_2 or 0.0) > 1.0

    def planner_args(self) -> dict:
        if not self.guided:
            return {"guidance_scale": 1.0, "guidance_scale_2": 1.0}
        return {"guidance_scale": self.scale, "guidance_scale_2": self.scale_2}


class CausalWanPipeline(LoadingMixin, DiffusionPipeline, WanLoraLoaderMixin, StreamMixin):
    """Causal, chunk-by-chunk text-to-video (and image-to-video, VACE; Wan2.1 and Wan2.2) with a KV cache.

    Args:
        tokenizer / text_encoder / vae / scheduler / transformer: as in ``WanPipeline`` (``transformer`` may be a
            ``WanVACETransformer3DModel``, as in ``WanVACEPipeline``).
        image_encoder / image_processor: Wan2.1 I2V only, as in ``WanImageToVideoPipeline``.
        transformer_2 / boundary_ratio / expand_timesteps: the Wan2.2 settings of the stock pipelines: A14B's
            low-noise expert and the timestep fraction below which it runs (on the timestep passed to the
            transformer; each expert has its own cache and every chunk is committed in both), and TI2V-5B's per-token
            timesteps (its image-to-video first frame at timestep 0).
        causal_config: the sampling defaults (:class:`~diffusers_causal_kv.CausalConfig` or its dict);
            ``from_pretrained`` reads ``causal_config.json`` from the folder (or its ``transformer/``) when not given.

    Each call and each stream is one :class:`~diffusers_causal_kv.RolloutSession`, which owns its conditioning,
    guidance, engines, noise and chunk plan; a stream reads nothing of the pipeline after it starts. A call runs on
    the transformers' ``kv_cache_engines``, which are made to be what ``causal_config`` describes (a
    :class:`~diffusers_causal_kv.RollingKVCacheEngine` per branch when it sets ``window_frames``, see
    :func:`~diffusers_causal_kv.pipelines.loading.install_engines`).
    """

    model_cpu_offload_seq = "text_encoder->image_encoder->transformer->vae"
    _optional_components = ["image_encoder", "image_processor", "transformer_2"]
    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]

    # The stock Wan pipelines' input preparation, reused as is (these functions only read the components).
    _get_t5_prompt_embeds = WanPipeline._get_t5_prompt_embeds
    encode_prompt = WanPipeline.encode_prompt
    encode_image = WanImageToVideoPipeline.encode_image
    _prepare_i2v_latents = WanImageToVideoPipeline.prepare_latents
    preprocess_conditions = WanVACEPipeline.preprocess_conditions
    prepare_video_latents = WanVACEPipeline.prepare_video_latents
    prepare_masks = WanVACEPipeline.prepare_masks

    def __init__(
        self,
        tokenizer: AutoTokenizer,
        text_encoder: UMT5EncoderModel,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchEulerDiscreteScheduler,
        transformer: WanTransformer3DModel | WanVACETransformer3DModel,
        image_encoder: CLIPVisionModel | None = None,
        image_processor: CLIPImageProcessor | None = None,
        transformer_2: WanTransformer3DModel | WanVACETransformer3DModel | None = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
        causal_config: CausalConfig | dict | None = None,
    ) -> None:
        super().__init__()
        self.register_modules(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                              transformer=transformer, image_encoder=image_encoder, image_processor=image_processor,
                              transformer_2=transformer_2)
        self.register_to_config(boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)
        if isinstance(causal_config, dict):
            causal_config = CausalConfig.from_dict(causal_config)
        self.causal_config = causal_config or CausalConfig()
        self._guidance_scale, self._guidance_scale_2 = 1.0, None  # the last call's, for its callbacks
        self.vae_scale_factor_temporal = vae.config.scale_factor_temporal if vae is not None else 4
        self.vae_scale_factor_spatial = vae.config.scale_factor_spatial if vae is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    # ------------------------------------------------------------------------------------------------ call state
    # Set by each __call__ for its callbacks (diffusers' convention); streams read none of it.
    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        return Guidance(self._guidance_scale, self._guidance_scale_2).guided

    @property
    def num_timesteps(self) -> int:
        """Denoising steps of the whole call (steps per chunk times chunks)."""
        return self._num_timesteps

    @property
    def current_timestep(self):
        return self._current_timestep

    @property
    def interrupt(self) -> bool:
        """Set by a callback to stop after the current chunk (the chunks made so far are returned)."""
        return self._interrupt

    @property
    def attention_kwargs(self) -> dict | None:
        return self._attention_kwargs

    @property
    def chunk_sizes(self) -> list[int]:
        """Latent frames per chunk of the last call, in order."""
        return self._chunk_sizes

    @property
    def chunk_seconds(self) -> list[float]:
        """Wall-clock seconds per chunk of the last call (denoising and commit, without text encoding or decoding)."""
        return self._chunk_seconds

    # ------------------------------------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        image=None,
        video=None,
        mask=None,
        reference_images=None,
        conditioning_scale: float | list[float] | torch.Tensor = 1.0,
        height: int = 480,
        width: int = 832,
        num_frames: int | None = None,
        chunk_frames: int | list[int] | None = None,
        timesteps: list[float] | None = None,
        shift: float | None = None,
        num_inference_steps: int | None = None,
        context_noise: float | None = None,
        context_noise_mode: str | None = None,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        num_videos_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end: Callable | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ("latents",),
        max_sequence_length: int = 512,
        cache_engines: dict | None = None,
        cfg_batch: bool = True,
    ) -> WanPipelineOutput | tuple:
        """Generate a video chunk by chunk with the KV cache.

        Args:
            prompt / negative_prompt / prompt_embeds / negative_prompt_embeds: the text conditioning, as in
                ``WanPipeline``; CFG runs when the guidance scale is above 1, through the cache tags ``"pos"`` and
                ``"neg"``.
            num_videos_per_prompt / max_sequence_length: as in ``WanPipeline``.
            image / image_embeds: Wan2.1 I2V (a transformer with ``image_dim``): the first frame, as in
                ``WanImageToVideoPipeline`` (the condition latents are sliced per chunk).
            video / mask / conditioning_scale: VACE control, as in ``WanVACEPipeline``; ``reference_images`` are
                refused (they would have to be prefilled before frame 0).
            height / width: multiples of 16.
            num_frames: video frames; with Wan's VAE a count that is not ``4k + 1`` is rounded down to one, as the
                stock pipelines do (default: the config's).
            chunk_frames / timesteps / shift / context_noise / context_noise_mode / guidance_scale: the causal
                sampling (default: the config's; see :class:`~diffusers_causal_kv.CausalConfig`).
            guidance_scale_2: Wan2.2 A14B: the low-noise expert's guidance scale (default ``guidance_scale``).
            num_inference_steps: sample each chunk with ``self.scheduler`` in that many steps instead of the
                few-step ``timesteps``.
            generator / latents: the random generator, or one per sample (a list: sample ``i``'s noise and
                re-noising come from ``generator[i]``, as in the stock pipelines); ``latents`` gives the initial noise
                of every latent frame ``[batch, channels, frames, h, w]`` instead of drawing it per chunk.
            output_type: ``"np"``, ``"pil"``, ``"pt"`` or ``"latent"``.
            return_dict: a ``WanPipelineOutput``, or a tuple.
            attention_kwargs: passed to every forward (``{"scale": s}``: the LoRA scale).
            callback_on_step_end / callback_on_step_end_tensor_inputs: called after every denoising step of every
                chunk as ``callback(pipe, step, timestep, callback_kwargs)``, with the global step index and, as
                ``"latents"``, the current chunk's latents; returned ``"latents"`` replace them. Changed prompt
                embeddings are refused (switch prompts between chunks with a stream).
            cache_engines: the engine map of this call; default the transformer's ``kv_cache_engines`` (made to be
                the engines ``causal_config`` describes).
            cfg_batch: with guidance, run a chunk's ``"pos"`` and ``"neg"`` passes as one forward over a batch of the
                two tags (default), ``False`` for two forwards (:class:`~diffusers_causal_kv.RolloutPlanner`).
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        settings = self.causal_config.replace(num_frames=num_frames, timesteps=timesteps, shift=shift,
                                              context_noise=context_noise, context_noise_mode=context_noise_mode,
                                              guidance_scale=guidance_scale)
        chunk_frames = settings.chunk_frames if chunk_frames is None else chunk_frames
        self._check_call(height, width, output_type, callback_on_step_end_tensor_inputs, reference_images)
        sampling = Sampling.create(settings.timesteps, settings.shift, settings.context_noise,
                                   settings.context_noise_mode, self.scheduler if num_inference_steps else None,
                                   num_inference_steps, settings.sampler,
                                   None if num_inference_steps else settings.first_chunk_timesteps)
        guidance = self._guidance_of(settings.guidance_scale, guidance_scale_2)
        num_frames = self._video_frames(settings.num_frames)
        self.install_processors(cache_engines)
        transformer, device = self.transformer, self._execution_device
        positive, negative = self._encode_prompts(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds,
                                         max_sequence_length, device, guidance.guided, num_videos_per_prompt)
        shape = self._latent_shape(positive.shape[0], num_frames, height, width)
        per_frame = call_inputs(self, topology(transformer), image, image_embeds, video, mask, conditioning_scale,
                                shape, num_frames, height, width, generator, device)
        if latents is not None and tuple(latents.shape) != shape:
            raise ValueError(f"latents have shape {tuple(latents.shape)} but this call needs {shape} (batch, "
                             "channels, latent frames, height / 8, width / 8).")
        planner = RolloutPlanner(self, positive, negative_prompt_embeds=negative, cache_engines=cache_engines,
                                 generator=generator, attention_kwargs=attention_kwargs, cfg_batch=cfg_batch,
                                 **guidance.planner_args(), **per_frame)
        sizes = chunk_schedule(shape[2], chunk_frames)
        session = make_session(planner, sampling, sizes=sizes, latent_shape=(*shape[:2], *shape[3:]), device=device,
                               latents=None if latents is None else latents.to(device, torch.float32))

        self._guidance_scale, self._guidance_scale_2 = guidance.scale, guidance.scale_2
        self._attention_kwargs, self._current_timestep, self._interrupt = attention_kwargs, None, False
        steps = sampling.steps
        self._num_timesteps = steps * len(sizes) + len(sampling.first_chunk().sigmas or ()) - len(
            sampling.sigmas or ())  # a first chunk of its own timesteps
        outputs, self._chunk_sizes, self._chunk_seconds = [], [], []
        with self.progress_bar(total=self._num_timesteps) as progress_bar:
            def on_step(chunk, step: int, t: float, x: torch.Tensor) -> torch.Tensor:
                self._current_timestep = t
                if callback_on_step_end is not None:
                    x = self._run_callback(callback_on_step_end, callback_on_step_end_tensor_inputs,
                                           len(outputs) * steps + step, t, x, positive, negative)
                progress_bar.update()
                return x

            while not self.interrupt and (made := session.step(on_step)) is not None:
                outputs.append(made.latents)
                self._chunk_sizes.append(made.chunk.size)
                self._chunk_seconds.append(made.seconds)
        self._current_timestep = None
        result = torch.cat(outputs, dim=2)
        video_out = result if output_type == "latent" else self._decode(result, output_type)
        self.maybe_free_model_hooks()
        return WanPipelineOutput(frames=video_out) if return_dict else (video_out,)

    # ------------------------------------------------------------------------------------------------ parts
    def _guidance_of(self, guidance_scale: float, guidance_scale_2: float | None) -> Guidance:
        """The guidance of a call or stream (``guidance_scale_2``, for ``transformer_2``, defaults to
        ``guidance_scale`` as in the stock pipelines)."""
        two = self.transformer_2 is not None
        return Guidance(guidance_scale, (guidance_scale if guidance_scale_2 is None else guidance_scale_2) if two
                        else None)

    def _encode_prompts(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, max_sequence_length,
                        device, guided: bool, num_videos_per_prompt: int = 1) -> tuple:
        """``(positive, negative)`` embeddings in the transformer's dtype (negative ``None`` without guidance), by the
        stock ``encode_prompt``."""
        if prompt_embeds is None and prompt is None:
            raise ValueError("CausalWanPipeline needs a prompt or prompt_embeds.")
        for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
            if text is not None and not (isinstance(text, str) or (
                    isinstance(text, list) and text and all(isinstance(t, str) for t in text))):
                raise TypeError(f"{name} must be a string or a non-empty list of strings, got {type(text).__name__} "
                                f"{text!r:.60}; pass text, or {name}_embeds for embeddings.")
        positive, negative = self.encode_prompt(
            prompt=prompt, negative_prompt=negative_prompt, do_classifier_free_guidance=guided,
            num_videos_per_prompt=num_videos_per_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=max_sequence_length, device=device)
        dtype = self.transformer.dtype
        return positive.to(dtype), None if negative is None or not guided else negative.to(dtype)

    def _latent_shape(self, batch: int, num_frames: int, height: int, width: int) -> tuple[int, ...]:
        """``(batch, channels, latent frames, h, w)`` of a video of ``num_frames`` frames."""
        spatial = self.vae_scale_factor_spatial
        return (batch, self.vae.config.z_dim, (num_frames - 1) // self.vae_scale_factor_temporal + 1,
                height // spatial, width // spatial)

    def _check_call(self, height, width, output_type, tensor_inputs, reference_images) -> None:
        if (self.transformer_2 is not None) != (self.config.boundary_ratio is not None):
            raise ValueError(
                "a two-expert pipeline needs both transformer_2 and boundary_ratio (the timestep fraction where "
                "transformer_2 takes over); pass both, or neither for one expert."
            )
        if height % 16 or width % 16:
            raise ValueError(f"height and width must be multiples of 16, got {height} x {width}.")
        if output_type not in ("np", "pil", "pt", "latent"):
            raise ValueError(f"output_type must be 'np', 'pil', 'pt' or 'latent', got {output_type!r}.")
        unknown = [k for k in tensor_inputs if k not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(f"callback_on_step_end_tensor_inputs {unknown} are not among the callback tensors "
                             f"{self._callback_tensor_inputs}.")
        if reference_images is not None:
            raise ValueError("reference_images are not supported by the causal VACE path yet; drop them (or "
                             "prefill their latents as clean frames with prefill() before a causal_rollout).")

    def _video_frames(self, num_frames: int) -> int:
        """``num_frames`` rounded down to ``4k + 1`` with a warning, as the stock Wan pipelines do; as it is for a VAE
        that does not compress time."""
        scale = self.vae_scale_factor_temporal
        if scale > 1 and num_frames % scale != 1:
            logger.warning(f"`num_frames - 1` has to be divisible by {scale}. Rounding to the nearest number.")
            num_frames = num_frames // scale * scale + 1
        return max(num_frames, 1)

    def _run_callback(self, callback, tensor_inputs, step, t, latents, prompt_embeds, negative_prompt_embeds):
        """Call ``callback_on_step_end``; returns the chunk latents it gives back."""
        given = {"latents": latents, "prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds}
        outputs = callback(self, step, t, {k: given[k] for k in tensor_inputs}) or {}
        for name in ("prompt_embeds", "negative_prompt_embeds"):
            new = outputs.get(name, given[name])
            if new is not given[name] and (new is None or not torch.equal(new, given[name])):
                raise ValueError(
                    f"callback_on_step_end changed {name} in the middle of a chunk; the cache of the earlier chunks "
                    "holds the old conditioning. Switch prompts between chunks with a stream (recache / "
                    "StreamingRollout.switch_prompt) instead."
                )
        return outputs.get("latents", latents)

    def _decode(self, latents: torch.Tensor, output_type: str):
        """Decode latents as the stock Wan pipelines do (un-normalise with the VAE's statistics, decode,
        post-process)."""
        vae = self.vae
        latents = latents.to(device=get_module_execution_device(vae), dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                             latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                                  latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        return self.video_processor.postprocess_video(video, output_type=output_type)
