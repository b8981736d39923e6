"""Per-task inputs of :class:`~diffusers_causal_kv.CausalWanPipeline`, prepared in one place for calls and streams.

A call has every frame of its conditioning up front and prepares it with the stock pipelines' own methods
(``WanImageToVideoPipeline.prepare_latents``, ``WanVACEPipeline.preprocess_conditions`` / ``prepare_video_latents``);
a stream receives frames as they come and encodes them chunk by chunk with a
:class:`~diffusers_causal_kv.StreamingVAEEncoder`. Both give the session a ``chunk_inputs(start_frame, size)`` map and
the per-rollout inputs (image embeddings, the VACE scale, Wan2.2 TI2V's first frame); the checks that refuse an input
the transformer cannot take are written once (:func:`check_image`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline

from ..session import shifted_sigmas
from ..streaming_vae import StreamingVAEEncoder
from .loading import takes_condition_latents


@dataclass(frozen=True)
class PromptEncoder:
    """Encodes a session's prompts with what was fixed when it started: the text encoder and tokenizer, whether
    guidance runs, the sequence length, device and the transformer's dtype. A stream switches prompts through it, so
    a later call on the pipeline (another guidance scale, say) cannot change how its prompts are encoded."""

    tokenizer: object
    text_encoder: object
    guided: bool
    max_sequence_length: int
    device: torch.device
    dtype: torch.dtype

    def encode(self, prompt: str | list[str]) -> torch.Tensor:
        """The embeddings of ``prompt``, as the stock ``encode_prompt`` computes them, in the transformer's dtype."""
        # The stock method reads only tokenizer and text_encoder of the object it is called on.
        return WanPipeline._get_t5_prompt_embeds(self, prompt, 1, self.max_sequence_length, self.device).to(self.dtype)

    def switch(self, prompt, negative_prompt, prompt_embeds: torch.Tensor | None,
               negative_prompt_embeds: torch.Tensor | None = None) -> tuple:
        """``(positive, negative)`` of a prompt switch: the negative is ``None`` (kept as it is) unless a new one is
        given (as text or embeddings) and guidance runs."""
        positive = self.encode(prompt) if prompt_embeds is None else prompt_embeds.to(self.device, self.dtype)
        negative = None
        if self.guided and negative_prompt_embeds is not None:
            negative = negative_prompt_embeds.to(self.device, self.dtype)
        elif self.guided and negative_prompt is not None:
            negative = self.encode(negative_prompt)
        return positive, negative


def check_image(pipe, image, conditioned: bool) -> None:
    """Refuse an image the transformer cannot take, or an I2V transformer without one."""
    if conditioned and image is None:
        raise ValueError("this transformer is an I2V model (it takes condition latents): pass image (the first frame).")
    if image is not None and not conditioned and not pipe.config.expand_timesteps:
        raise ValueError("image was given but the transformer is not an I2V model; drop it.")


def image_embeds_of(pipe, image, image_embeds, batch: int, device) -> torch.Tensor:
    """Wan2.1 I2V image-encoder embeddings, repeated to the batch, in the transformer's dtype."""
    embeds = pipe.encode_image(image, device) if image_embeds is None else image_embeds
    return embeds.repeat(batch // embeds.shape[0], 1, 1).to(pipe.transformer.dtype)


def vace_scale(pipe, conditioning_scale, device) -> torch.Tensor:
    """The per-VACE-layer scale."""
    layers = len(pipe.transformer.config.vace_layers)
    scale = torch.as_tensor(conditioning_scale, dtype=torch.float32).reshape(-1).expand(layers)
    return scale.to(device, pipe.transformer.dtype)


def call_inputs(pipe, kind, image, image_embeds, video, mask, conditioning_scale, shape, num_frames, height, width,
                generator, device) -> dict:
    """The planner's I2V, TI2V or VACE inputs of a call (covering every frame), by the stock pipelines' methods."""
    batch, dtype = shape[0], pipe.transformer.dtype
    if kind.is_vace:
        video, mask, refs = pipe.preprocess_conditions(video, mask, None, batch, height, width, num_frames,
                                                       torch.float32, device)
        # The mask is downsampled in time causally (as a stream must), not by the stock prepare_masks.
        masks = causal_vace_mask(mask, True, pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal)
        control = torch.cat([pipe.prepare_video_latents(video, mask, refs, generator, device), masks.to(video.dtype)],
                            dim=1)
        return {"control_latents": control.to(dtype), "control_scale": vace_scale(pipe, conditioning_scale, device)}
    conditioned = takes_condition_latents(pipe.transformer)
    check_image(pipe, image, conditioned)
    if image is None:
        return {}
    pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
    # The stock preparation also returns noise; only the condition is used (the noise is drawn per chunk).
    prepared = pipe._prepare_i2v_latents(pixels, batch, shape[1], height, width, num_frames, torch.float32, device,
                                         generator, torch.zeros(shape))
    if pipe.config.expand_timesteps:  # Wan2.2 TI2V: the image is latent frame 0, at timestep 0
        return {"first_frame_latents": prepared[1]}
    inputs = {"condition_latents": prepared[1].to(dtype)}
    if kind.is_i2v:  # Wan2.1 I2V: image-encoder embeddings too (Wan2.2 I2V-A14B takes none)
        inputs["image_embeds"] = image_embeds_of(pipe, image, image_embeds, batch, device)
    return inputs


def stream_inputs(pipe, kind, image, image_embeds, control_video, control_mask, conditioning_scale, video, used,
                  shift, height, width, device, batch) -> dict:
    """The inputs of a stream: ``chunk_inputs(start_frame, size) -> dict`` for its session (with ``"start"``, the
    noise-to-start-latents map of video-to-video), and the per-stream ``image_embeds`` / ``control_scale`` /
    ``first_frame_latents``. Everything the chunks need (encoders, frame feeds) is made here, once: a resumed stream
    continues with the same objects."""
    dtype, spatial, temporal = pipe.transformer.dtype, pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    conditioned = takes_condition_latents(pipe.transformer)
    if video is not None and (conditioned or kind.is_vace or image is not None):
        raise ValueError("video-to-video streams take a text-to-video transformer; drop video= for I2V / VACE.")
    check_image(pipe, image, conditioned)
    out: dict = {}
    if kind.is_vace:
        out["control_scale"] = vace_scale(pipe, conditioning_scale, device)
    feeds, encoders, processor, vae = {}, {}, pipe.video_processor, pipe.vae
    if image is not None:
        first = processor.preprocess(image, height=height, width=width).to(device, torch.float32)
    if image is not None and pipe.config.expand_timesteps:  # TI2V: the image alone is latent frame 0
        latents = StreamingVAEEncoder(vae).encode(first.unsqueeze(2).to(vae.dtype)).to(torch.float32)
        out["first_frame_latents"] = latents.repeat(batch // latents.shape[0], 1, 1, 1, 1)
    elif conditioned:
        if kind.is_i2v:
            out["image_embeds"] = image_embeds_of(pipe, image, image_embeds, batch, device)
        encoders["condition"] = StreamingVAEEncoder(vae)
    if kind.is_vace:  # without a control video or mask: the stock defaults (no control, everything generated)
        feeds["control"] = (FrameFeed(processor, control_video, height, width, device, "control video")
                            if control_video is not None else ConstantFeed(0.0, height, width, device))
        feeds["mask"] = (FrameFeed(processor, control_mask, height, width, device, "control mask")
                         if control_mask is not None else ConstantFeed(1.0, height, width, device))
        encoders["inactive"], encoders["reactive"] = StreamingVAEEncoder(vae), StreamingVAEEncoder(vae)
    if video is not None:
        feeds["video"] = FrameFeed(processor, video, height, width, device, "input video")
        encoders["video"] = StreamingVAEEncoder(vae)
        sigma = float(shifted_sigmas([used[0]], shift)[0])

    def chunk_inputs(start: int, size: int) -> dict:
        count = video_frames_of(start, size, temporal)
        if "condition" in encoders:
            frames = torch.zeros(batch, 3, count, height, width, device=device)
            if start == 0:
                frames[:, :, :1] = first.unsqueeze(2)
            latents = encoders["condition"].encode(frames.to(vae.dtype)).to(torch.float32)
            mask = torch.zeros(batch, temporal, size, *latents.shape[3:], device=device)
            if start == 0:
                mask[:, :, 0] = 1
            return {"condition_latents": torch.cat([mask, latents], dim=1).to(dtype)}
        if kind.is_vace:
            control = feeds["control"].take(count).to(vae.dtype)
            mask = torch.clamp((feeds["mask"].take(count) + 1) / 2, 0, 1)
            binary = torch.where(mask > 0.5, 1.0, 0.0).to(vae.dtype)
            parts = [encoders["inactive"].encode(control * (1 - binary)),
                     encoders["reactive"].encode(control * binary),
                     causal_vace_mask(mask, start == 0, spatial, temporal).to(vae.dtype)]
            return {"control_latents": torch.cat(parts, dim=1).to(dtype)}
        if video is not None:
            z = encoders["video"].encode(feeds["video"].take(count).to(vae.dtype)).to(torch.float32)
            z = z.repeat(batch // z.shape[0], 1, 1, 1, 1)
            return {"start": lambda noise: (1 - sigma) * z + sigma * noise}
        return {}

    out["chunk_inputs"] = chunk_inputs
    return out


def causal_vace_mask(mask: torch.Tensor, first_frame: bool, spatial: int, temporal: int = 4) -> torch.Tensor:
    """The VACE mask channels of a chunk, causally: latent frame ``j`` takes the mask of the last video frame of its
    group of ``temporal`` (frame 0 for latent frame 0), and each ``spatial x spatial`` pixel block becomes
    ``spatial ** 2`` channels as in ``WanVACEPipeline.prepare_masks``. The stock method instead resamples the mask
    over the whole video at once (``nearest-exact``), which needs every frame before the first chunk.

    ``mask``: ``[1, channels, frames, H, W]`` in ``[0, 1]`` covering the chunk's video frames (``first_frame``: they
    start at video frame 0); channel 0 is read."""
    picked = mask[0, 0, 0::temporal] if first_frame else mask[0, 0, temporal - 1::temporal]
    frames, height, width = picked.shape
    blocks = picked.reshape(frames, height // spatial, spatial, width // spatial, spatial)
    return blocks.permute(2, 4, 0, 1, 3).flatten(0, 1).unsqueeze(0)  # [1, spatial**2, frames, h, w]


class FrameFeed:
    """Video frames from an iterable, handed out per chunk, preprocessed to ``[1, 3, frames, H, W]`` in ``[-1, 1]``
    as the stock pipelines preprocess a video."""

    def __init__(self, processor, frames: Iterable, height: int, width: int, device, what: str) -> None:
        self._processor, self._frames, self._what = processor, iter(frames), what
        self._height, self._width, self._device, self._taken = height, width, device, 0

    def take(self, count: int) -> torch.Tensor:
        frames = list(itertools.islice(self._frames, count))
        if len(frames) < count:
            raise ValueError(
                f"the {self._what} ran out after {self._taken + len(frames)} frames, but the stream's next chunk "
                f"needs {count}; give as many frames as the stream generates, or stop it earlier."
            )
        self._taken += count
        return self._processor.preprocess_video(frames, self._height, self._width).to(self._device, torch.float32)


class ConstantFeed:
    """Frames of one preprocessed value (``[1, 3, frames, H, W]``): the stock VACE defaults, a zero control video
    and a mask of ones, when a stream is given none."""

    def __init__(self, value: float, height: int, width: int, device) -> None:
        self._value, self._size, self._device = value, (height, width), device

    def take(self, count: int) -> torch.Tensor:
        return torch.full((1, 3, count, *self._size), self._value, device=self._device)


def video_frames_of(start_frame: int, size: int, temporal: int = 4) -> int:
    """Video frames that latent frames ``start_frame ... start_frame + size - 1`` cover, for a VAE compressing time
    by ``temporal``: latent frame 0 is video frame 0, every later latent frame ``temporal`` more."""
    return 1 + temporal * (size - 1) if start_frame == 0 else temporal * size
