"""``CausalWanPipeline``: the diffusers pipeline of a causal Wan checkpoint, from a prompt to a video.

It is composed from the components of the stock Wan pipelines (tokenizer, UMT5 text encoder, ``AutoencoderKLWan``,
scheduler, a ``WanTransformer3DModel`` or ``WanVACETransformer3DModel``, and for Wan2.1 I2V the CLIP image encoder
and processor), so ``CausalWanPipeline.from_pipe(WanPipeline / WanImageToVideoPipeline / WanVACEPipeline)`` reuses
a loaded stock pipeline's objects as they are. Text, image and control inputs are prepared by the stock pipelines'
own methods; the sampling is the package's chunked rollout (:func:`~diffusers_causal_kv.rollout.rollout_chunks` on
a :class:`~diffusers_causal_kv.RolloutPlanner`), with the checkpoint's :class:`~diffusers_causal_kv.CausalConfig`
(``causal_config.json``) as the defaults of every sampling argument.

Random numbers are drawn in one documented order, so a stream can reproduce a pipeline call: per chunk, in chunk
order, the chunk's initial noise ``randn_tensor([batch, channels, chunk_frames, h, w], generator)`` (unless
``latents`` are given), then one draw of the chunk's shape per re-noising between few-step steps, then the commit's
draw (``context_noise_mode="renoise"`` with ``context_noise > 0`` only).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable

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
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.pipelines.wan.pipeline_wan_vace import WanVACEPipeline
from diffusers.utils import logging
from diffusers.utils.torch_utils import get_module_execution_device, randn_tensor
from diffusers.video_processor import VideoProcessor
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

from .causal_config import CausalConfig
from .kv_cache import RollingKVCacheEngine
from .masks import chunk_schedule
from .model import experts_of, topology
from .pipeline_stream import CausalWanStream, FrameFeed, causal_vace_mask, video_frames_of
from .planner import Chunk, RolloutPlanner, check_context_noise
from .processors import CausalWanAttnProcessor
from .rollout import rollout_chunks, shifted_sigmas
from .streaming import StreamingRollout, expert_engines
from .streaming_vae import StreamingVAEEncoder

logger = logging.get_logger(__name__)


def install_causal_processors(transformer: torch.nn.Module) -> None:
    """Install ``CausalWanAttnProcessor`` over the stock ``WanAttnProcessor`` of every attention module, keeping each
    module's attention backend (``set_attention_backend``'s choice). Outside a ``CausalContext`` it computes what
    the stock processor computes, so other pipelines sharing the transformer see no change. A transformer that has
    the causal processors is left as it is; processors of another kind are refused rather than overwritten."""
    modules = topology(transformer).attention()
    if _has_causal_processors(transformer):
        return  # installed (a partial installation is refused with the model layer's own error)
    foreign = sorted({type(a.processor).__name__ for a in modules if type(a.processor) is not WanAttnProcessor})
    if foreign:
        raise TypeError(
            f"the transformer's attention modules run {', '.join(foreign)}; the causal pipelines install "
            "CausalWanAttnProcessor only over the stock WanAttnProcessor, so as not to drop yours. Call "
            "transformer.set_attn_processor(CausalWanAttnProcessor()) yourself to replace them."
        )
    for attn in modules:
        causal = CausalWanAttnProcessor()
        causal._attention_backend = attn.processor._attention_backend
        attn.set_processor(causal)


def _takes_condition_latents(transformer) -> bool:
    """Whether the transformer takes I2V condition latents (mask and image latents) beside the noisy ones: Wan2.1
    I2V and Wan2.2 I2V-A14B, told by their input channels (I2V-A14B has no image embeddings to tell it by)."""
    return transformer.config.in_channels != transformer.config.out_channels


def _has_causal_processors(transformer: torch.nn.Module) -> bool:
    return any(isinstance(attn.processor, CausalWanAttnProcessor) for attn in topology(transformer).attention())


class CausalWanPipeline(DiffusionPipeline, WanLoraLoaderMixin):
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

    The processors are installed at the first call when the transformer has none (with a
    :class:`~diffusers_causal_kv.RollingKVCacheEngine` on every branch when the config sets ``window_frames``).
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
        self._guidance_scale, self._guidance_scale_2 = 1.0, None
        self.vae_scale_factor_temporal = vae.config.scale_factor_temporal if vae is not None else 4
        self.vae_scale_factor_spatial = vae.config.scale_factor_spatial if vae is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``DiffusionPipeline.from_pretrained``, plus ``causal_config.json`` from a local folder (its root, then its
        ``transformer/``) when ``causal_config`` is not passed."""
        if "causal_config" not in kwargs and os.path.isdir(pretrained_model_name_or_path):
            root = str(pretrained_model_name_or_path)
            kwargs["causal_config"] = CausalConfig.find([root, os.path.join(root, "transformer")])
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``DiffusionPipeline.save_pretrained``, plus the pipeline's ``causal_config.json``."""
        super().save_pretrained(save_directory, *args, **kwargs)
        self.causal_config.save(save_directory)

    # ------------------------------------------------------------------------------------------------ state
    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self._guidance_scale > 1.0 or (self._guidance_scale_2 or 0.0) > 1.0

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

    def cache_memory_bytes(self, cache_engines: dict | None = None) -> dict[str, int]:
        """Bytes the KV cache holds, per expert: ``{"transformer": n}``, and ``"transformer_2"`` too for a two-expert
        Wan2.2 A14B pipeline (each expert caches the K/V of its own weights, so the cache is held twice).

        ``cache_engines``: the engine map of a call or a stream (``stream.rollout.cache_engines``); default the
        transformers' own ``kv_cache_engines``."""
        names = ("transformer", "transformer_2")
        return {name: sum(engine.memory_bytes() for engine in engines.values())
                for name, (_, engines) in zip(names, expert_engines(self, cache_engines))}

    def install_processors(self) -> None:
        """:func:`install_causal_processors` on the transformer (and ``transformer_2``), with a
        :class:`~diffusers_causal_kv.RollingKVCacheEngine` per branch when ``causal_config.window_frames`` is set and
        no engines were set."""
        config = self.causal_config
        for transformer in experts_of(self):  # Wan2.2 A14B: both experts, each with its own engines
            if (config.window_frames is not None and getattr(transformer, "kv_cache_engines", None) is None
                    and not _has_causal_processors(transformer)):
                transformer.kv_cache_engines = {
                    branch: RollingKVCacheEngine(config.window_frames, config.sink_frames, config.positions)
                    for branch in topology(transformer).branches}
            install_causal_processors(transformer)

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
            prompt / negative_prompt / prompt_embeds / negative_prompt_embeds / max_sequence_length /
            num_videos_per_prompt: the text conditioning, as in ``WanPipeline``; CFG runs when the guidance scale
                is above 1, through the cache tags ``"pos"`` and ``"neg"``.
            image / image_embeds: Wan2.1 I2V (a transformer with ``image_dim``): the first frame, as in
                ``WanImageToVideoPipeline`` (the condition latents are sliced per chunk).
            video / mask / conditioning_scale: VACE control, as in ``WanVACEPipeline``; ``reference_images`` are
                refused (they would have to be prefilled before frame 0).
            height / width: multiples of 16. num_frames: video frames; a count that is not ``4k + 1`` is rounded
                down to one, as the stock pipelines do (default: the config's).
            chunk_frames / timesteps / shift / context_noise / context_noise_mode / guidance_scale: the causal
                sampling (default: the config's; see :class:`~diffusers_causal_kv.CausalConfig`).
            guidance_scale_2: Wan2.2 A14B: the low-noise expert's guidance scale (default ``guidance_scale``).
            num_inference_steps: sample each chunk with ``self.scheduler`` in that many steps instead of the
                few-step ``timesteps``.
            generator / latents: the random generator; ``latents`` gives the initial noise of every latent frame
                ``[batch, channels, frames, h, w]`` instead of drawing it per chunk.
            output_type: ``"np"``, ``"pil"``, ``"pt"`` or ``"latent"``. return_dict: a ``WanPipelineOutput``, or a
                tuple.
            attention_kwargs: passed to every forward (``{"scale": s}``: the LoRA scale).
            callback_on_step_end / callback_on_step_end_tensor_inputs: called after every denoising step of every
                chunk as ``callback(pipe, step, timestep, callback_kwargs)``, with the global step index and, as
                ``"latents"``, the current chunk's latents; returned ``"latents"`` replace them. Changed prompt
                embeddings are refused (switch prompts between chunks with a stream).
            cache_engines: the engine map of this call; default the transformer's ``kv_cache_engines``.
            cfg_batch: with guidance, run a chunk's ``"pos"`` and ``"neg"`` passes as one forward over a batch of the
                two tags (default), ``False`` for two forwards (:class:`~diffusers_causal_kv.RolloutPlanner`).
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        settings = self.causal_config.replace(num_frames=num_frames, timesteps=timesteps, shift=shift,
                                              context_noise=context_noise, context_noise_mode=context_noise_mode,
                                              guidance_scale=guidance_scale)
        chunk_frames = settings.chunk_frames if chunk_frames is None else chunk_frames
        check_context_noise(settings.context_noise, settings.context_noise_mode)
        self._check_call(height, width, output_type, callback_on_step_end_tensor_inputs, reference_images, generator)
        num_frames = self._video_frames(settings.num_frames)
        self.install_processors()
        transformer, device = self.transformer, self._execution_device
        kind = topology(transformer)

        self._set_guidance(settings.guidance_scale, guidance_scale_2)
        self._attention_kwargs, self._current_timestep, self._interrupt = attention_kwargs, None, False
        if prompt_embeds is None and prompt is None:
            raise ValueError("CausalWanPipeline needs a prompt or prompt_embeds.")
        prompt_embeds, negative_prompt_embeds = self._prompt_embeds(
            prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, max_sequence_length, device,
            num_videos_per_prompt)
        dtype = transformer.dtype
        batch = prompt_embeds.shape[0]
        shape = (batch, self.vae.config.z_dim, (num_frames - 1) // self.vae_scale_factor_temporal + 1,
                 height // self.vae_scale_factor_spatial, width // self.vae_scale_factor_spatial)
        per_frame = self._per_frame_inputs(kind, image, image_embeds, video, mask, conditioning_scale, shape,
                                           num_frames, height, width, generator, device, dtype)
        if latents is not None and tuple(latents.shape) != shape:
            raise ValueError(f"latents have shape {tuple(latents.shape)} but this call needs {shape} (batch, "
                             "channels, latent frames, height / 8, width / 8).")

        planner = RolloutPlanner(
            self, prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, cache_engines=cache_engines,
            generator=generator, attention_kwargs=attention_kwargs, cfg_batch=cfg_batch, **self._guidance(),
            **per_frame)
        template = torch.zeros(shape, device=device) if latents is None else latents.to(device, torch.float32)
        chunks = planner.plan(template, chunk_frames)
        scheduler = self.scheduler if num_inference_steps else None
        sigmas = None if scheduler else shifted_sigmas(settings.timesteps, settings.shift).tolist()
        if scheduler is not None:
            scheduler.set_timesteps(num_inference_steps, device=device)
        steps = len(scheduler.timesteps) if scheduler is not None else len(sigmas)
        planner.check(template, chunks)
        planner.clear()
        self._num_timesteps = steps * len(chunks)

        def noise_for(chunk: Chunk) -> torch.Tensor:
            if latents is not None:
                return template[:, :, chunk.offset:chunk.offset + chunk.size]
            return randn_tensor((*shape[:2], chunk.size, *shape[3:]), generator=generator, device=device,
                                dtype=torch.float32)

        outputs, self._chunk_sizes, self._chunk_seconds = [], [], []
        with self.progress_bar(total=self._num_timesteps) as progress_bar:
            def on_step(chunk: Chunk, step: int, t: float, x: torch.Tensor) -> torch.Tensor:
                self._current_timestep = t
                if callback_on_step_end is not None:
                    x = self._run_callback(callback_on_step_end, callback_on_step_end_tensor_inputs,
                                           len(outputs) * steps + step, t, x, prompt_embeds, negative_prompt_embeds)
                progress_bar.update()
                return x

            for chunk, x, seconds in rollout_chunks(planner, chunks, noise_for, sigmas=sigmas, scheduler=scheduler,
                                                    num_inference_steps=num_inference_steps,
                                                    context_noise=settings.context_noise,
                                                    context_noise_mode=settings.context_noise_mode, on_step=on_step):
                outputs.append(x)
                self._chunk_sizes.append(chunk.size)
                self._chunk_seconds.append(seconds)
                if self.interrupt:
                    break
        self._current_timestep = None
        result = torch.cat(outputs, dim=2)
        video_out = result if output_type == "latent" else self._decode(result, output_type)
        self.maybe_free_model_hooks()
        return WanPipelineOutput(frames=video_out) if return_dict else (video_out,)

    # ------------------------------------------------------------------------------------------------ stream
    @torch.no_grad()
    def stream(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        image=None,
        control_video: Iterable | None = None,
        control_mask: Iterable | None = None,
        conditioning_scale: float = 1.0,
        video: Iterable | None = None,
        strength: float = 1.0,
        height: int = 480,
        width: int = 832,
        num_frames: int | None = None,
        chunk_frames: int | None = None,
        timesteps: list[float] | None = None,
        shift: float | None = None,
        context_noise: float | None = None,
        context_noise_mode: str | None = None,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        generator: torch.Generator | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        attention_kwargs: dict | None = None,
        max_sequence_length: int = 512,
        cache_engines: dict | None = None,
        window_frames: int | None = None,
        sink_frames: int | None = None,
        positions: str = "relative",
        prompt_schedule: dict[int, str] | None = None,
        prompt_switch: str = "recache",
        resume: CausalWanStream | None = None,
        overlap: bool | None = None,
        cfg_batch: bool = True,
    ) -> CausalWanStream:
        """Generate chunk by chunk and yield each chunk's frames as soon as it is decoded (:class:`StreamChunk`).

        Args:
            num_frames: video frames to generate (``4k + 1``, split into chunks as a pipeline call splits them;
                with ``resume``, a multiple of 4 more); ``None`` streams until the stream is closed.
            cache_engines: the stream's engine map; default a fresh
                :class:`~diffusers_causal_kv.RollingKVCacheEngine` per branch, with ``window_frames`` /
                ``sink_frames`` (default: the config's, else 21 and 0) and ``positions`` (``"relative"``: no length
                limit; ``"absolute"`` stops at the model's ``rope_max_seq_len``).
            image / image_embeds: Wan2.1 I2V: the first frame (its condition is encoded causally, chunk by chunk).
            control_video / control_mask / conditioning_scale: VACE: iterables of frames (and masks), consumed
                chunk by chunk; the mask is downsampled in time causally (:func:`causal_vace_mask`).
            video / strength: video-to-video: an iterable of input frames, encoded chunk by chunk and noised to the
                level of ``strength`` (the few-step timesteps at or below ``strength * 1000`` are run, from the
                first of them); ``strength=1`` is text-to-video with the same noise.
            prompt_schedule: ``{chunk_index: prompt}``: switch prompts before those chunks, by ``prompt_switch``
                (``"recache"``: re-cache the window under the new prompt, LongLive; ``"cross"``: new
                cross-attention entries only). :meth:`CausalWanStream.switch_prompt` does the same while it runs.
            resume: a closed stream to continue (its cache, window, decoder and frame counters); the other inputs
                must describe the same video.
            overlap: decode chunk *k* while the transformer makes chunk *k + 1* (a side CUDA stream; one chunk of
                lookahead, see :mod:`~diffusers_causal_kv.pipeline_stream`); default on CUDA devices only.
            Other arguments as in :meth:`__call__`.
        """
        settings = self.causal_config.replace(num_frames=num_frames, timesteps=timesteps, shift=shift,
                                              context_noise=context_noise, context_noise_mode=context_noise_mode,
                                              guidance_scale=guidance_scale, window_frames=window_frames,
                                              sink_frames=sink_frames)
        chunk = settings.chunk_frames if chunk_frames is None else chunk_frames
        check_context_noise(settings.context_noise, settings.context_noise_mode)
        self._check_call(height, width, output_type, [], None, generator)
        if resume is not None and not resume.closed:
            raise ValueError("resume= takes a closed stream; close() it first (a running stream owns its cache).")
        if not 0 < strength <= 1:
            raise ValueError(f"strength must lie in (0, 1], got {strength!r}.")
        used = [t for t in settings.timesteps if t <= strength * 1000] if video is not None else settings.timesteps
        if not used:
            raise ValueError(f"strength={strength} keeps none of the timesteps {list(settings.timesteps)}; raise it "
                             f"to at least {min(settings.timesteps) / 1000}.")
        self.install_processors()
        device, kind = self._execution_device, topology(self.transformer)
        self._set_guidance(settings.guidance_scale, guidance_scale_2)

        def encode(text, negative_text=None):
            return self._prompt_embeds(text, negative_text, None, None, max_sequence_length, device)

        if prompt_embeds is None and prompt is None:
            raise ValueError("CausalWanPipeline needs a prompt or prompt_embeds.")
        positive, negative = self._prompt_embeds(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds,
                                                 max_sequence_length, device)
        shape = (positive.shape[0], self.vae.config.z_dim, 0, height // self.vae_scale_factor_spatial,
                 width // self.vae_scale_factor_spatial)
        scale = self.vae_scale_factor_temporal
        if num_frames is None:
            sizes = itertools.repeat(chunk)
        elif resume is None:
            sizes = iter(chunk_schedule((self._video_frames(num_frames) - 1) // scale + 1, chunk))
        else:  # after frame 0, every latent frame is 4 more video frames
            if num_frames % scale or num_frames <= 0:
                raise ValueError(f"a resumed stream continues in groups of {scale} video frames; num_frames must be a "
                                 f"positive multiple of {scale}, got {num_frames}.")
            sizes = iter(chunk_schedule(num_frames // scale, chunk))
        inputs = self._stream_inputs(kind, image, image_embeds, control_video, control_mask, conditioning_scale,
                                     video, used, settings.shift, height, width, device, shape[0])
        if resume is not None:
            rollout = resume.rollout
            rollout.prompts["pos"] = positive
        else:
            engines = cache_engines or self._stream_engines(settings, chunk, positions)
            rollout = StreamingRollout(
                self, positive, negative_prompt_embeds=negative if self.do_classifier_free_guidance else None,
                chunk_frames=chunk, timesteps=used, shift=settings.shift, context_noise=settings.context_noise,
                context_noise_mode=settings.context_noise_mode, cache_engines=engines, generator=generator,
                image_embeds=inputs.pop("image_embeds", None), control_scale=inputs.pop("control_scale", None),
                first_frame_latents=inputs.pop("first_frame_latents", None), attention_kwargs=attention_kwargs,
                cfg_batch=cfg_batch, **self._guidance())
        made = CausalWanStream(self, rollout, shape=shape, sizes=sizes, generator=generator, encode_prompt=encode,
                               prompt_schedule=prompt_schedule, switch_mode=prompt_switch, output_type=output_type,
                               inputs=inputs["per_chunk"], decode=output_type != "latent",
                               overlap=device.type == "cuda" if overlap is None else overlap)
        if resume is not None:
            made.take_over(resume)
        return made

    def _prompt_embeds(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, max_sequence_length,
                       device, num_videos_per_prompt: int = 1) -> tuple:
        """``(positive, negative)`` embeddings in the transformer's dtype (negative ``None`` without CFG), by the
        stock ``encode_prompt``."""
        positive, negative = self.encode_prompt(
            prompt=prompt, negative_prompt=negative_prompt,
            do_classifier_free_guidance=self.do_classifier_free_guidance, num_videos_per_prompt=num_videos_per_prompt,
            prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            max_sequence_length=max_sequence_length, device=device)
        dtype = self.transformer.dtype
        return positive.to(dtype), None if negative is None else negative.to(dtype)

    def _stream_engines(self, settings: CausalConfig, chunk: int, positions: str) -> dict:
        """A fresh rolling engine per branch (and per expert): the config's window (21 latent frames, Self-Forcing's
        training length, when it names none) and sink."""
        window = max(settings.window_frames or 21, chunk + settings.sink_frames)
        maps = [{branch: RollingKVCacheEngine(window, settings.sink_frames, positions=positions)
                 for branch in topology(transformer).branches} for transformer in experts_of(self)]
        return maps[0] if len(maps) == 1 else {"transformer": maps[0], "transformer_2": maps[1]}

    def _set_guidance(self, guidance_scale: float, guidance_scale_2: float | None) -> None:
        """The call's guidance scales (``guidance_scale_2``, for ``transformer_2``, defaults to ``guidance_scale``
        as in the stock pipelines)."""
        self._guidance_scale = guidance_scale
        two = self.transformer_2 is not None
        self._guidance_scale_2 = (guidance_scale if guidance_scale_2 is None else guidance_scale_2) if two else None

    def _guidance(self) -> dict:
        """The planner's guidance arguments: no CFG at all unless a scale is above 1, as in the stock pipelines."""
        if not self.do_classifier_free_guidance:
            return {"guidance_scale": 1.0, "guidance_scale_2": 1.0}
        return {"guidance_scale": self._guidance_scale, "guidance_scale_2": self._guidance_scale_2}

    def _stream_inputs(self, kind, image, image_embeds, control_video, control_mask, conditioning_scale, video, used,
                       shift, height, width, device, batch) -> dict:
        """The per-chunk inputs of a stream: ``per_chunk(start_frame, size) -> dict`` for
        :meth:`StreamingRollout.generate` (plus ``"start"``, the noise-to-start-latents map of video-to-video), and
        the per-stream ``image_embeds`` / ``control_scale``."""
        dtype, spatial = self.transformer.dtype, self.vae_scale_factor_spatial
        conditioned = _takes_condition_latents(self.transformer)
        if video is not None and (conditioned or kind.is_vace or image is not None):
            raise ValueError("video-to-video streams take a text-to-video transformer; drop video= for I2V / VACE.")
        out: dict = {}
        if kind.is_vace:
            layers = len(self.transformer.config.vace_layers)
            scale = torch.as_tensor(conditioning_scale, dtype=torch.float32).reshape(-1).expand(layers)
            out["control_scale"] = scale.to(device, dtype)
        feeds, encoders = {}, {}
        if conditioned and image is None:
            raise ValueError("this transformer is an I2V model (it takes condition latents): pass image (the "
                             "first frame).")
        if image is not None and not conditioned and not self.config.expand_timesteps:
            raise ValueError("image was given but the transformer is not an I2V model; drop it.")
        if image is not None:
            first = self.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
        if image is not None and self.config.expand_timesteps:  # TI2V: the image alone is latent frame 0
            latents = StreamingVAEEncoder(self.vae).encode(first.unsqueeze(2).to(self.vae.dtype)).to(torch.float32)
            out["first_frame_latents"] = latents.repeat(batch // latents.shape[0], 1, 1, 1, 1)
        elif conditioned:
            if kind.is_i2v:
                embeds = self.encode_image(image, device) if image_embeds is None else image_embeds
                out["image_embeds"] = embeds.repeat(batch // embeds.shape[0], 1, 1).to(dtype)
            encoders["condition"] = StreamingVAEEncoder(self.vae)
        if kind.is_vace:
            blank = itertools.repeat(torch.zeros(height, width, 3))
            feeds["control"] = FrameFeed(self, control_video if control_video is not None else blank, height,
                                         width, "control video")
            ones = itertools.repeat(torch.ones(height, width, 1))
            feeds["mask"] = FrameFeed(self, control_mask if control_mask is not None else ones, height, width,
                                      "control mask")
            encoders["inactive"], encoders["reactive"] = StreamingVAEEncoder(self.vae), StreamingVAEEncoder(self.vae)
        if video is not None:
            feeds["video"] = FrameFeed(self, video, height, width, "input video")
            encoders["video"] = StreamingVAEEncoder(self.vae)
            sigma = float(shifted_sigmas([used[0]], shift)[0])

        def per_chunk(start: int, size: int) -> dict:
            count = video_frames_of(start, size)
            if "condition" in encoders:
                frames = torch.zeros(batch, 3, count, height, width, device=device)
                if start == 0:
                    frames[:, :, :1] = first.unsqueeze(2)
                latents = encoders["condition"].encode(frames.to(self.vae.dtype)).to(torch.float32)
                mask = torch.zeros(batch, self.vae_scale_factor_temporal, size, *latents.shape[3:], device=device)
                if start == 0:
                    mask[:, :, 0] = 1
                return {"condition_latents": torch.cat([mask, latents], dim=1).to(dtype)}
            if kind.is_vace:
                control = feeds["control"].take(count).to(self.vae.dtype)
                mask = torch.clamp((feeds["mask"].take(count) + 1) / 2, 0, 1)
                binary = torch.where(mask > 0.5, 1.0, 0.0).to(self.vae.dtype)
                parts = [encoders["inactive"].encode(control * (1 - binary)),
                         encoders["reactive"].encode(control * binary),
                         causal_vace_mask(mask, start == 0, spatial).to(self.vae.dtype)]
                return {"control_latents": torch.cat(parts, dim=1).to(dtype)}
            if video is not None:
                z = encoders["video"].encode(feeds["video"].take(count).to(self.vae.dtype)).to(torch.float32)
                z = z.repeat(batch // z.shape[0], 1, 1, 1, 1)
                return {"start": lambda noise: (1 - sigma) * z + sigma * noise}
            return {}

        out["per_chunk"] = per_chunk
        return out

    # ------------------------------------------------------------------------------------------------ parts
    def _check_call(self, height, width, output_type, tensor_inputs, reference_images, generator) -> None:
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
        if isinstance(generator, list):
            raise ValueError("a list of generators is not supported by the causal pipeline (its noise is drawn per "
                             "chunk); pass one torch.Generator.")

    def _video_frames(self, num_frames: int) -> int:
        """``num_frames`` rounded down to ``4k + 1`` with a warning, as the stock Wan pipelines do."""
        scale = self.vae_scale_factor_temporal
        if num_frames % scale != 1:
            logger.warning(f"`num_frames - 1` has to be divisible by {scale}. Rounding to the nearest number.")
            num_frames = num_frames // scale * scale + 1
        return max(num_frames, 1)

    def _per_frame_inputs(self, kind, image, image_embeds, video, mask, conditioning_scale, shape, num_frames,
                          height, width, generator, device, dtype) -> dict:
        """The planner's I2V or VACE inputs, prepared by the stock pipelines' own methods."""
        batch = shape[0]
        if kind.is_vace:
            layers = len(self.transformer.config.vace_layers)
            scale = torch.as_tensor(conditioning_scale, dtype=torch.float32).reshape(-1).expand(layers)
            video, mask, refs = self.preprocess_conditions(video, mask, None, batch, height, width, num_frames,
                                                           torch.float32, device)
            # The mask is downsampled in time causally (as a stream must), not by the stock prepare_masks.
            masks = causal_vace_mask(mask, True, self.vae_scale_factor_spatial).to(video.dtype)
            control = torch.cat([self.prepare_video_latents(video, mask, refs, generator, device), masks], dim=1)
            return {"control_latents": control.to(dtype), "control_scale": scale.to(device, dtype)}
        conditioned = _takes_condition_latents(self.transformer)
        if image is None:
            if conditioned:
                raise ValueError("this transformer is an I2V model (it takes condition latents): pass image (the "
                                 "first frame).")
            return {}
        if not conditioned and not self.config.expand_timesteps:
            raise ValueError("image was given but the transformer is not an I2V model; drop it.")
        pixels = self.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
        # The stock preparation also returns noise; only the condition is used (the noise is drawn per chunk).
        prepared = self._prepare_i2v_latents(pixels, batch, shape[1], height, width, num_frames, torch.float32,
                                             device, generator, torch.zeros(shape))
        if self.config.expand_timesteps:  # Wan2.2 TI2V: the image is latent frame 0, at timestep 0
            return {"first_frame_latents": prepared[1]}
        inputs = {"condition_latents": prepared[1].to(dtype)}
        if kind.is_i2v:  # Wan2.1 I2V: image-encoder embeddings too (Wan2.2 I2V-A14B takes none)
            embeds = self.encode_image(image, device) if image_embeds is None else image_embeds
            inputs["image_embeds"] = embeds.repeat(batch // embeds.shape[0], 1, 1).to(dtype)
        return inputs

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
