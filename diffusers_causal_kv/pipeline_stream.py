"""``CausalWanPipeline.stream()``: frames on screen while the rollout runs.

A :class:`CausalWanStream` generates one chunk at a time on a
:class:`~diffusers_causal_kv.StreamingRollout` (which keeps the window's clean latents for a re-cache), decodes the
chunk as soon as it is committed with a :class:`~diffusers_causal_kv.StreamingVAEDecoder`, and yields a
:class:`StreamChunk`. Per-frame inputs arrive chunk by chunk: the Wan2.1 I2V condition and a VACE control video or a
video-to-video input are encoded with a :class:`~diffusers_causal_kv.StreamingVAEEncoder` as their frames come.

Random numbers are drawn in the pipeline's documented order (per chunk: its noise, then its re-noising draws), so
with the same seed, chunk schedule and engines a stream's frames equal the pipeline call's.

Overlap: on a CUDA device the decode of chunk *k* runs on a second CUDA stream while the transformer denoises chunk
*k + 1* on the default one (the frames are handed out once the decode is done); elsewhere it runs in line, with the
same frames.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

from .streaming import StreamingRollout
from .streaming_vae import StreamingVAEDecoder

SWITCH_MODES = ("recache", "cross")


@dataclass
class StreamChunk:
    """One chunk of a stream."""

    index: int
    """The chunk's index in the stream (0, 1, ...)."""
    frames: object
    """Its decoded video frames in the stream's ``output_type`` (``None`` for ``"latent"``)."""
    latents: torch.Tensor
    """Its clean latents ``[batch, channels, chunk frames, h, w]``."""
    latent_frames: range
    """Its latent frames (absolute, in the cache)."""
    video_frames: range
    """Its video frames: latent frame 0 decodes to video frame 0, every later latent frame to 4 more."""
    seconds: float
    """This chunk's latency: denoising, commit and decoding."""
    time_to_frames: float
    """Seconds from the start of the stream until this chunk's frames were ready (the first chunk's is the time to
    first frame)."""


class CausalWanStream:
    """An iterator of :class:`StreamChunk`; made by :meth:`CausalWanPipeline.stream`.

    :meth:`switch_prompt` (callable while the stream runs, e.g. from another thread) takes effect at the next chunk,
    as does a ``prompt_schedule`` entry. :meth:`close` (or leaving a ``with`` block) ends it; the caches then hold
    exactly the chunks that were yielded, and :attr:`rollout` can continue from them.
    """

    def __init__(self, pipe, rollout: StreamingRollout, *, shape: tuple, sizes: Iterator[int], generator,
                 encode_prompt: Callable, prompt_schedule: dict | None, switch_mode: str, output_type: str,
                 inputs: Callable[[int, int], dict], decode: bool) -> None:
        self.pipe, self.rollout = pipe, rollout
        self._shape, self._sizes, self._generator = shape, sizes, generator
        self._encode_prompt, self._schedule = encode_prompt, dict(prompt_schedule or {})
        self._switch_mode, self._output_type, self._inputs = switch_mode, output_type, inputs
        self._decoder = StreamingVAEDecoder(pipe.vae) if decode else None
        self._pending: tuple | None = None
        self._index, self._video_frame, self._began = 0, 0, None
        self._closed = False

    def __iter__(self) -> CausalWanStream:
        return self

    def __enter__(self) -> CausalWanStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take_over(self, closed: CausalWanStream) -> None:
        """Continue where ``closed`` stopped: its decoder (the VAE's temporal cache), chunk and frame counters and
        pending prompt switch (:meth:`CausalWanPipeline.stream` with ``resume=``)."""
        self._decoder = closed._decoder if self._decoder is not None else None
        self._index, self._video_frame, self._pending = closed._index, closed._video_frame, closed._pending

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the stream (the caches keep the chunks yielded so far)."""
        self._closed = True

    def switch_prompt(self, prompt: str | None = None, negative_prompt: str | None = None, *,
                      prompt_embeds: torch.Tensor | None = None, mode: str | None = None) -> None:
        """Use a new prompt from the next chunk on: ``mode="recache"`` re-caches the window under it (LongLive),
        ``"cross"`` only swaps the cross-attention entries (default: the stream's ``prompt_switch``)."""
        mode = mode or self._switch_mode
        if mode not in SWITCH_MODES:
            raise ValueError(f"prompt switch mode must be 'recache' or 'cross', got {mode!r}.")
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("switch_prompt takes a prompt or prompt_embeds (one of the two).")
        self._pending = (prompt, negative_prompt, prompt_embeds, mode)

    @torch.no_grad()
    def __next__(self) -> StreamChunk:
        if self._closed:
            raise StopIteration
        size = next(self._sizes, None)
        if size is None:
            self._closed = True
            raise StopIteration
        if self._began is None:
            self._began = time.perf_counter()
        began = time.perf_counter()
        self._apply_switch()
        start = self.rollout.next_frame
        inputs = self._inputs(start, size)
        noise = randn_tensor((*self._shape[:2], size, *self._shape[3:]), generator=self._generator,
                             device=self.pipe._execution_device, dtype=torch.float32)
        start_latents = inputs.pop("start", lambda n: n)(noise)
        latents = self.rollout.generate(start_latents, chunk_frames=[size], **inputs).latents
        frames = self._decode(latents)
        video = video_frames_of(start, size)
        chunk = StreamChunk(self._index, frames, latents, range(start, start + size),
                            range(self._video_frame, self._video_frame + video), time.perf_counter() - began,
                            time.perf_counter() - self._began)
        self._index, self._video_frame = self._index + 1, self._video_frame + video
        return chunk

    def _apply_switch(self) -> None:
        if self._index in self._schedule:
            self._pending = (self._schedule.pop(self._index), None, None, self._switch_mode)
        if self._pending is None:
            return
        prompt, negative_prompt, embeds, mode = self._pending
        self._pending = None
        positive, negative = (embeds, None) if embeds is not None else self._encode_prompt(prompt, negative_prompt)
        if self._index == 0:  # nothing cached yet: the new prompt applies as is
            self.rollout.prompts.update({"pos": positive, **({"neg": negative} if negative is not None
                                                              and "neg" in self.rollout.prompts else {})})
            return
        self.rollout.switch_prompt(positive, negative, mode=mode)

    def _decode(self, latents: torch.Tensor):
        if self._decoder is None:
            return None
        if latents.device.type != "cuda":
            return self.pipe.video_processor.postprocess_video(self._decoder.decode(latents), self._output_type)
        side = torch.cuda.Stream(latents.device)  # decode beside the transformer's next chunk
        side.wait_stream(torch.cuda.current_stream(latents.device))
        with torch.cuda.stream(side):
            video = self._decoder.decode(latents)
        torch.cuda.current_stream(latents.device).wait_stream(side)
        return self.pipe.video_processor.postprocess_video(video, self._output_type)


def causal_vace_mask(mask: torch.Tensor, first_frame: bool, spatial: int) -> torch.Tensor:
    """The VACE mask channels of a chunk, causally: latent frame ``j`` takes the mask of video frame ``4j`` (the
    last frame of its group of 4; frame 0 for latent frame 0), and each ``spatial x spatial`` pixel block becomes
    ``spatial ** 2`` channels as in ``WanVACEPipeline.prepare_masks``. The stock method instead resamples the mask
    over the whole video at once (``nearest-exact``), which needs every frame before the first chunk.

    ``mask``: ``[1, 1, frames, H, W]`` in ``[0, 1]`` covering the chunk's video frames (``first_frame``: they start
    at video frame 0)."""
    picked = mask[0, 0, 0::4] if first_frame else mask[0, 0, 3::4]
    frames, height, width = picked.shape
    blocks = picked.view(frames, height // spatial, spatial, width // spatial, spatial)
    return blocks.permute(2, 4, 0, 1, 3).flatten(0, 1).unsqueeze(0)  # [1, spatial**2, frames, h, w]


class FrameFeed:
    """Video frames from an iterable, handed out per chunk (:func:`video_frames_of` of them), preprocessed to
    ``[1, 3, frames, H, W]`` in ``[-1, 1]`` as the stock pipelines preprocess a video."""

    def __init__(self, pipe, frames: Iterable, height: int, width: int, what: str) -> None:
        self._pipe, self._frames, self._height, self._width, self._what = pipe, iter(frames), height, width, what
        self._taken = 0

    def take(self, count: int) -> torch.Tensor:
        frames = []
        for _ in range(count):
            frame = next(self._frames, None)
            if frame is None:
                raise ValueError(
                    f"the {self._what} ran out after {self._taken + len(frames)} frames, but the stream's next chunk "
                    f"needs {count}; give as many frames as the stream generates, or stop it earlier."
                )
            frames.append(frame)
        self._taken += count
        return self._pipe.video_processor.preprocess_video(frames, self._height, self._width).to(
            self._pipe._execution_device, torch.float32)


def video_frames_of(start_frame: int, size: int) -> int:
    """Video frames that latent frames ``start_frame ... start_frame + size - 1`` cover."""
    return 1 + 4 * (size - 1) if start_frame == 0 else 4 * size
