"""``CausalWanPipeline.stream()``: setting up a stream (its session, inputs, engines and prompt schedule).

Everything a stream needs is resolved here, once, from the call's arguments and the pipeline's causal config; the
:class:`~diffusers_causal_kv.pipelines.stream.CausalWanStream` it returns then reads nothing of the pipeline.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from ..causal_config import CausalConfig
from ..kv_cache import RollingKVCacheEngine
from ..masks import chunk_schedule
from ..model import experts_of, topology
from ..planner import RolloutPlanner
from ..rolling_forcing import make_session
from ..session import Sampling
from .inputs import PromptEncoder, stream_inputs
from .loading import install_causal_processors, takes_condition_latents
from .stream import CausalWanStream, check_switch


class StreamMixin:
    """:meth:`stream` of :class:`~diffusers_causal_kv.CausalWanPipeline`."""

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
        positions: str | None = None,
        prompt_schedule: dict[int, str] | None = None,
        prompt_switch: str = "recache",
        resume: CausalWanStream | None = None,
        overlap: bool | None = None,
        cfg_batch: bool = True,
    ) -> CausalWanStream:
        """Generate chunk by chunk and yield each chunk's frames as soon as it is decoded (:class:`StreamChunk`).

        Arguments not listed below are as in :meth:`__call__`.

        Args:
            num_frames: video frames to generate (``4k + 1`` with Wan's VAE, split into chunks as a pipeline call
                splits them; with ``resume``, a multiple of the VAE's temporal factor more); ``None`` streams until the
                stream is closed.
            cache_engines: the stream's engine map; default a fresh
                :class:`~diffusers_causal_kv.RollingKVCacheEngine` per branch, with ``window_frames`` /
                ``sink_frames`` (default: the config's, else 21 and 0) and ``positions`` (default: the config's when
                it sets a window, so a stream gives the frames a call gives; else ``"relative"``: no length limit;
                ``"absolute"`` stops at the model's ``rope_max_seq_len``).
            image / image_embeds: Wan2.1 I2V: the first frame (its condition is encoded causally, chunk by chunk).
            control_video / control_mask / conditioning_scale: VACE: iterables of frames (and masks), consumed
                chunk by chunk; the mask is downsampled in time causally (:func:`causal_vace_mask`).
            video / strength: video-to-video: an iterable of input frames, encoded chunk by chunk and noised to the
                level of ``strength`` (the few-step timesteps at or below ``strength * 1000`` are run, from the
                first of them); ``strength=1`` is text-to-video with the same noise.
            prompt_schedule: ``{chunk_index: prompt}``: switch prompts before those chunks, by ``prompt_switch``
                (``"recache"``: re-cache the window under the new prompt, LongLive; ``"cross"``: new
                cross-attention entries only); the negative prompt is kept. :meth:`CausalWanStream.switch_prompt`
                does the same while it runs. An entry past the stream's end, or a re-cache switch of an I2V or VACE
                stream, is refused before any work.
            resume: a closed stream to continue: its session (cache, window, conditioning, noise, per-frame input
                feeds and encoders) and decoder; its image, control and input-video inputs continue as they were
                (the ones given here are not read). A prompt that differs from the stream's is a prompt switch
                before the next chunk. ``generator``, when given, must be the stream's own.
            overlap: decode chunk *k* while the transformer makes chunk *k + 1* (a side CUDA stream; one chunk of
                lookahead, see :mod:`~diffusers_causal_kv.pipelines.stream`); default on CUDA devices only.
        """
        settings = self.causal_config.replace(num_frames=num_frames, timesteps=timesteps, shift=shift,
                                              context_noise=context_noise, context_noise_mode=context_noise_mode,
                                              guidance_scale=guidance_scale, window_frames=window_frames,
                                              sink_frames=sink_frames)
        windowed = self.causal_config.window_frames is not None
        given_positions, positions = positions, positions or (settings.positions if windowed else "relative")
        chunk = settings.chunk_frames if chunk_frames is None else chunk_frames
        largest = chunk if isinstance(chunk, int) else max(chunk)  # what a window and a re-cache must hold
        self._check_call(height, width, output_type, [], None)
        if resume is not None:
            _check_resume(resume, output_type, dict(cache_engines=cache_engines, window_frames=window_frames,
                                                    sink_frames=sink_frames, positions=given_positions))
        if not 0 < strength <= 1:
            raise ValueError(f"strength must lie in (0, 1], got {strength!r}.")
        used = [t for t in settings.timesteps if t <= strength * 1000] if video is not None else settings.timesteps
        if not used:
            raise ValueError(f"strength={strength} keeps none of the timesteps {list(settings.timesteps)}; raise it "
                             f"to at least {min(settings.timesteps) / 1000}.")
        first = settings.first_chunk_timesteps  # video-to-video: the first chunk's, at or below the strength too
        first = first if first is None or video is None else [t for t in first if t <= strength * 1000] or None
        sampling = Sampling.create(used, settings.shift, settings.context_noise, settings.context_noise_mode,
                                   sampler=settings.sampler, first_chunk_timesteps=first)
        guidance = self._guidance_of(settings.guidance_scale, guidance_scale_2)
        if resume is not None:  # what was given again must be what the session runs
            given = [name for name, value in (("timesteps", timesteps), ("shift", shift),
                                               ("strength", None if strength == 1 else strength),
                                               ("context_noise", context_noise),
                                               ("context_noise_mode", context_noise_mode)) if value is not None]
            if given and sampling != resume.session.sampling:
                raise ValueError(f"a resumed stream keeps its session's sampling; {given} differ from it: drop them.")
            scales = [e.guidance_scale for e in resume.session.planner.experts]
            asked = list(guidance.planner_args().values())[:len(scales)]
            if (guidance_scale is not None or guidance_scale_2 is not None) and asked != scales:
                raise ValueError(f"a resumed stream keeps its session's guidance {scales}; drop guidance_scale= / "
                                 "guidance_scale_2=.")
        kind, device, temporal = topology(self.transformer), self._execution_device, self.vae_scale_factor_temporal
        text_only = not (kind.is_vace or kind.is_i2v or takes_condition_latents(self.transformer))
        sizes = self._stream_sizes(num_frames, chunk, resume, largest)
        first_index = 0 if resume is None else resume.session.index
        if resume is not None:  # the closed stream's switches still to come are checked with the new ones
            prompt_schedule = {**resume._schedule, **(prompt_schedule or {})}
        # a chunk that failed before the stream was closed is made first: one chunk more
        extra = 0 if resume is None else int(resume.session.pending_frames > 0)
        schedule = _checked_schedule(prompt_schedule, first_index, sizes, prompt_switch, text_only, extra)
        if resume is not None:
            session = resume.session
            if generator is not None and generator is not session.planner.noise.generator:
                raise ValueError("a resumed stream continues with its own noise; drop generator= or pass the stream's.")
        for transformer in experts_of(self):
            install_causal_processors(transformer)
        prompts = PromptEncoder(self.tokenizer, self.text_encoder, guidance.guided if resume is None else
                                "neg" in resume.session.prompts, max_sequence_length, device, self.transformer.dtype)
        if resume is None:
            positive, negative = self._encode_prompts(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds,
                                                      max_sequence_length, device, guidance.guided)
            shape = self._latent_shape(positive.shape[0], 1, height, width)
            inputs = stream_inputs(self, kind, image, image_embeds, control_video, control_mask, conditioning_scale,
                                   video, used, settings.shift, height, width, device, shape[0])
            # a rolling-forcing window forward covers one chunk per timestep
            widest = largest * (len(used) if settings.sampler == "rolling_forcing" else 1)
            engines = cache_engines or self._stream_engines(settings, widest, positions)
            planner = RolloutPlanner(self, positive, negative_prompt_embeds=negative, cache_engines=engines,
                                     generator=generator, image_embeds=inputs.get("image_embeds"),
                                     control_scale=inputs.get("control_scale"),
                                     first_frame_latents=inputs.get("first_frame_latents"),
                                     attention_kwargs=attention_kwargs, cfg_batch=cfg_batch, **guidance.planner_args())
            session = make_session(planner, sampling, sizes=sizes, latent_shape=(*shape[:2], *shape[3:]),
                                   device=device, chunk_inputs=inputs["chunk_inputs"], keep_window=True,
                                   recache_frames=largest)
        else:
            session.replan(sizes, keep_pending=True)  # a chunk that failed is made first, from the inputs it drew
        made = CausalWanStream(session, prompts=prompts, processor=self.video_processor, vae=self.vae,
                               output_type=output_type, prompt_schedule=schedule, switch_mode=prompt_switch,
                               temporal=temporal, overlap=device.type == "cuda" if overlap is None else overlap)
        if resume is not None:
            made.take_over(resume)
            if prompt is not None or prompt_embeds is not None:  # a new prompt for the rest: a switch, as any other
                positive, negative = prompts.switch(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds)
                if not (_same(positive, session.prompts[session.planner.cache_tag])
                        and (negative is None or _same(negative, session.prompts["neg"]))):
                    made.switch_prompt(prompt_embeds=positive, negative_prompt_embeds=negative, mode=prompt_switch)
        return made

    def _stream_sizes(self, num_frames: int | None, chunk: int | list[int], resume, largest: int):
        """The chunk plan of a stream: endless (a list of sizes: those chunks, then its last size for ever), or the
        latent frames of ``num_frames`` video frames (after frame 0, every latent frame is the VAE's temporal factor
        more video frames); a resumed stream's chunk that failed is made first and counts among them."""
        scale = self.vae_scale_factor_temporal
        resumed = resume is not None
        if num_frames is None:
            return itertools.repeat(chunk) if isinstance(chunk, int) else itertools.chain(
                chunk, itertools.repeat(chunk[-1]))
        if not resumed:
            return chunk_schedule((self._video_frames(num_frames) - 1) // scale + 1, chunk)
        if num_frames % scale or num_frames <= 0:
            raise ValueError(f"a resumed stream continues in groups of {scale} video frames; num_frames must be a "
                             f"positive multiple of {scale}, got {num_frames}.")
        left = num_frames // scale - resume.session.pending_frames
        if left < 0:
            raise ValueError(f"the resumed stream first makes again the chunk of {resume.session.pending_frames} "
                             f"latent frames that failed; num_frames={num_frames} is fewer video frames than that "
                             "chunk.")
        return chunk_schedule(left, chunk) if left else []

    def _stream_engines(self, settings: CausalConfig, largest: int, positions: str) -> dict:
        """A fresh rolling engine per branch (and per expert): the config's window (21 latent frames, Self-Forcing's
        training length, when it names none, and at least the largest pass, ``largest`` frames, beside the sink) and
        sink."""
        window = max(settings.window_frames or 21, largest + settings.sink_frames)
        maps = [{branch: RollingKVCacheEngine(window, settings.sink_frames, positions=positions)
                 for branch in topology(transformer).branches} for transformer in experts_of(self)]
        return maps[0] if len(maps) == 1 else {"transformer": maps[0], "transformer_2": maps[1]}


def _checked_schedule(schedule: dict | None, first_index: int, sizes, mode: str, text_only: bool,
                      extra: int = 0) -> dict:
    """``prompt_schedule``, refused before any work if an entry is not a chunk index of the stream (its ``sizes``,
    after ``extra`` chunks made first), falls past its end, or asks for a re-cache an I2V / VACE stream cannot
    make."""
    schedule = dict(schedule or {})
    check_switch(mode, can_recache=text_only or not schedule)
    end = first_index + extra + len(sizes) if isinstance(sizes, list) else None
    bad = [k for k in schedule if isinstance(k, bool) or not isinstance(k, int) or k < first_index
           or (end is not None and k >= end)]
    if bad:
        last = "" if end is None else f"..{end - 1}"
        raise ValueError(f"prompt_schedule entries {bad} are not chunks of this stream (chunk indices "
                         f"{first_index}{last}); schedule switches within the stream, or stream more frames.")
    return schedule


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b.to(a.device, a.dtype))


def _check_resume(resume, output_type: str, engines: dict) -> None:
    """Refuse a resume that cannot continue ``resume`` as given (a running stream, another kind of output, other
    engines), before any work."""
    if not resume.closed:
        raise ValueError("resume= takes a closed stream; close() it first (a running stream owns its cache).")
    if (resume._decoder is None) != (output_type == "latent"):
        raise ValueError("a resumed stream decodes as the closed one did (its VAE cache continues the video): keep "
                         "output_type 'latent', or a decoded type, as it was.")
    given = sorted(name for name, value in engines.items() if value is not None)
    if given:
        raise ValueError(f"a resumed stream keeps its session's engines; drop {given}.")
