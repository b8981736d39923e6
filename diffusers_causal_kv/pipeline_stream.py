"""``CausalWanPipeline.stream()``: frames on screen while the rollout runs.

A :class:`CausalWanStream` generates one chunk at a time on a
:class:`~diffusers_causal_kv.StreamingRollout` (which keeps the window's clean latents for a re-cache), decodes the
chunk as soon as it is committed with a :class:`~diffusers_causal_kv.StreamingVAEDecoder`, and yields a
:class:`StreamChunk`. Per-frame inputs arrive chunk by chunk: the Wan2.1 I2V condition and a VACE control video or a
video-to-video input are encoded with a :class:`~diffusers_causal_kv.StreamingVAEEncoder` as their frames come.

Random numbers are drawn in the pipeline's documented order (per chunk: its noise, then its re-noising draws), so
with the same seed, chunk schedule and engines a stream's frames equal the pipeline call's.

Overlap (``overlap=True``, the default on CUDA): chunk *k* is decoded on a second CUDA stream, from a worker thread,
while the transformer makes chunk *k + 1* on the default stream; chunk *k*'s frames are handed out once both are
done. The price is one chunk of lookahead: a prompt switch asked for after chunk *k* was handed out applies from
chunk *k + 2*, and closing the stream leaves chunk *k + 1* committed too (a ``resume`` hands it out first).
Elsewhere (``overlap=False``, the default off CUDA) every chunk is made, then decoded, in line; the frames are the same
either way (tested on CPU with ``overlap=True``, where the same order runs without a side stream).
"""

from __future__ import annotations

import concurrent.futures
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
                 inputs: Callable[[int, int], dict], decode: bool, overlap: bool) -> None:
        self.pipe, self.rollout = pipe, rollout
        self._shape, self._sizes, self._generator = shape, sizes, generator
        self._encode_prompt, self._schedule = encode_prompt, dict(prompt_schedule or {})
        self._switch_mode, self._output_type, self._inputs = switch_mode, output_type, inputs
        self._decoder = StreamingVAEDecoder(pipe.vae) if decode else None
        self._pending: tuple | None = None
        self._index, self._video_frame, self._began = 0, 0, None
        self._closed, self._overlap, self._ahead, self._executor = False, overlap, None, None

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
        self._ahead = closed._ahead  # a chunk made ahead (overlap) is handed out first

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the stream. The caches keep the chunks yielded so far, plus, with ``overlap``, the one made ahead
        (a ``resume`` hands it out first)."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

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
        made = self._ahead if self._ahead is not None else self._make()
        self._ahead = None
        if made is None:
            self._closed = True
            raise StopIteration
        index, latents, start, began = made
        if not self._overlap or self._decoder is None:
            frames = self._decode(latents)
        else:  # decode chunk k on a side stream and thread while the transformer makes chunk k + 1
            decoding = self._worker().submit(self._decode, latents)
            self._ahead = self._make()
            frames = decoding.result()
        size, video = latents.shape[2], video_frames_of(start, latents.shape[2])
        now = time.perf_counter()
        chunk = StreamChunk(index, frames, latents, range(start, start + size),
                            range(self._video_frame, self._video_frame + video), now - began, now - self._began)
        self._video_frame += video
        return chunk

    def _make(self) -> tuple | None:
        """Denoise and commit the next chunk: ``(index, latents, start frame, start time)``, or ``None`` at the
        end of the schedule."""
        size = next(self._sizes, None)
        if size is None:
            return None
        began = time.perf_counter()
        self._began = began if self._began is None else self._began
        self._apply_switch()
        start = self.rollout.next_frame
        inputs = self._inputs(start, size)
        noise = randn_tensor((*self._shape[:2], size, *self._shape[3:]), generator=self._generator,
                             device=self.pipe._execution_device, dtype=torch.float32)
        start_latents = inputs.pop("start", lambda n: n)(noise)
        latents = self.rollout.generate(start_latents, chunk_frames=[size], **inputs).latents
        self._index += 1
        return self._index - 1, latents, start, began

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="causal-wan-decode")
        return self._executor

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

    @torch.no_grad()
    def _decode(self, latents: torch.Tensor):
        if self._decoder is None:
            return None
        if not self._overlap or latents.device.type != "cuda":
            return self.pipe.video_processor.postprocess_video(self._decoder.decode(latents), self._output_type)
        side = torch.cuda.Stream(latents.device)  # beside the default stream, where the next chunk runs
        side.wait_stream(torch.cuda.default_stream(latents.device))  # the latents are written
        with torch.cuda.stream(side):
            video = self._decoder.decode(latents)
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
