"""``CausalWanPipeline.stream()``: frames on screen while the rollout runs.

A :class:`CausalWanStream` is an iterator over its :class:`~diffusers_causal_kv.RolloutSession`: it makes one chunk
at a time, decodes it as soon as it is committed with a :class:`~diffusers_causal_kv.StreamingVAEDecoder`, and
yields a :class:`StreamChunk`. Everything it uses was fixed when it started (the session, the prompt encoder, the
decoder and video processor, the per-frame input feeds); it never reads the pipeline's attributes afterwards.

Random numbers are drawn in the pipeline's documented order (per chunk: its noise, then its re-noising draws), so
with the same seed, chunk schedule and engines a stream's frames equal the pipeline call's.

After an error: a chunk whose forward (or prompt switch) raised is made again, with the same inputs and noise, when
the caller iterates again; the video then has every chunk exactly once and equals an undisturbed stream. With
``overlap``, a chunk already made and decoded when making the next one raised is handed out first.

Overlap (``overlap=True``, the default on CUDA): chunk *k* is decoded on a second CUDA stream, from a worker thread,
while the transformer makes chunk *k + 1* on the default stream; chunk *k*'s frames are handed out once both are
done. The price is one chunk of lookahead: a prompt switch asked for after chunk *k* was handed out applies from
chunk *k + 2*, and closing the stream leaves chunk *k + 1* committed too (a ``resume`` hands it out first).
Elsewhere (``overlap=False``, the default off CUDA) every chunk is made, then decoded, in line; the frames are the same
either way (tested on CPU with ``overlap=True``, where the same order runs without a side stream).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from ..session import RolloutSession, SessionChunk
from ..streaming_vae import StreamingVAEDecoder
from .inputs import PromptEncoder, video_frames_of

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
    """Its video frames: latent frame 0 decodes to video frame 0, every later latent frame to as many more as the
    VAE compresses time (4 for Wan's VAE, 1 for a VAE that does not)."""
    seconds: float
    """This chunk's latency: denoising, commit and decoding."""
    time_to_frames: float
    """Seconds from the start of the stream until this chunk's frames were ready (the first chunk's is the time to
    first frame)."""


class CausalWanStream:
    """An iterator of :class:`StreamChunk`; made by :meth:`CausalWanPipeline.stream`. Its :attr:`session` holds
    the cache, the window's latents, the conditioning and where the video stands (``session.next_frame``).

    :meth:`switch_prompt` (callable while the stream runs, e.g. from another thread) takes effect at the next chunk,
    as does a ``prompt_schedule`` entry. :meth:`close` (or leaving a ``with`` block) ends it; the caches then hold
    exactly the chunks that were yielded (with ``overlap``, plus the one made ahead), and ``resume=`` continues.
    """

    def __init__(self, session: RolloutSession, *, prompts: PromptEncoder, processor, vae, output_type: str,
                 prompt_schedule: dict | None, switch_mode: str, temporal: int, overlap: bool) -> None:
        self.session = session
        self._prompts, self._processor, self._output_type = prompts, processor, output_type
        self._decoder = StreamingVAEDecoder(vae) if output_type != "latent" else None
        self._schedule, self._switch_mode, self._temporal = dict(prompt_schedule or {}), switch_mode, temporal
        self._pending: tuple | None = None  # a prompt switch to apply before the next chunk
        self._switching = threading.Lock()  # switch_prompt may come from another thread
        self._ahead: tuple | None = None  # overlap: the next chunk, made while this one was decoded
        self._undecoded: tuple | None = None  # made (committed) but not handed out yet: its decode failed or runs
        self._ready: StreamChunk | None = None  # a finished chunk to hand out before anything else
        self._began: float | None = None
        self._closed, self._overlap, self._executor = False, overlap, None

    def __iter__(self) -> CausalWanStream:
        return self

    def __enter__(self) -> CausalWanStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def take_over(self, closed: CausalWanStream) -> None:
        """Continue where ``closed`` stopped: its decoder (the VAE's temporal cache), its pending prompt switch and
        schedule, and a chunk it made ahead or had ready (:meth:`CausalWanPipeline.stream` with ``resume=``)."""
        self._decoder = closed._decoder  # its temporal cache continues the video (the output types agree)
        self._pending, self._ahead, self._ready = closed._pending, closed._ahead, closed._ready
        self._undecoded, self._began = closed._undecoded, closed._began

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
                      prompt_embeds: torch.Tensor | None = None, negative_prompt_embeds: torch.Tensor | None = None,
                      mode: str | None = None) -> None:
        """Use a new prompt from the next chunk on: ``mode="recache"`` re-caches the window under it (LongLive),
        ``"cross"`` only swaps the cross-attention entries (default: the stream's ``prompt_switch``). The negative
        prompt is kept unless ``negative_prompt`` (or ``negative_prompt_embeds``) is given."""
        mode = mode or self._switch_mode
        check_switch(mode, can_recache=self.session.can_recache)
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("switch_prompt takes a prompt or prompt_embeds (one of the two).")
        with self._switching:
            self._pending = (prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, mode)

    @torch.no_grad()
    def __next__(self) -> StreamChunk:
        if self._closed:
            raise StopIteration
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        if self._undecoded is None:
            made = self._ahead if self._ahead is not None else self._make()
            self._ahead = None
            if made is None:
                self._closed = True
                raise StopIteration
            self._undecoded = made  # committed: kept until handed out, also when its decode raises
        made = self._undecoded
        if not self._overlap or self._decoder is None:
            return self._hand_out(made, self._decode(made[0].latents))
        decoding = self._worker().submit(self._decode, made[0].latents)  # while the transformer makes the next
        try:
            if self._ahead is None:
                self._ahead = self._make()
        except BaseException:
            with contextlib.suppress(Exception):  # the forward's error is the one raised; a decode error waits
                self._ready = self._hand_out(made, decoding.result())  # made and decoded: handed out next
            raise
        return self._hand_out(made, decoding.result())

    def _hand_out(self, made: tuple[SessionChunk, float], frames) -> StreamChunk:
        self._undecoded = None
        return self._finish(made, frames)

    def _finish(self, made: tuple[SessionChunk, float], frames) -> StreamChunk:
        piece, began = made
        start, size = piece.chunk.frame, piece.chunk.size
        first_video = 0 if start == 0 else 1 + self._temporal * (start - 1)
        now = time.perf_counter()
        return StreamChunk(piece.index, frames, piece.latents, range(start, start + size),
                           range(first_video, first_video + video_frames_of(start, size, self._temporal)),
                           now - began, now - self._began)

    def _make(self) -> tuple[SessionChunk, float] | None:
        """Denoise and commit the next chunk (after the switch due before it): ``(chunk, start time)``, or ``None``
        at the end of the plan."""
        if self.session.peek_size() is None:
            return None
        began = time.perf_counter()
        self._began = began if self._began is None else self._began
        self._apply_switch()
        return self.session.step(), began

    def _apply_switch(self) -> None:
        """The switches due before the next chunk: its scheduled one, then one asked for with :meth:`switch_prompt`.
        Each is dropped only once applied, so a switch that raised is applied again on the retry, and one asked for
        from another thread meanwhile is kept."""
        index = self.session.index
        if index in self._schedule:
            self._switch(self._schedule[index])
            del self._schedule[index]
        with self._switching:
            taken = self._pending
        if taken is None:
            return
        self._switch(*taken)
        with self._switching:
            if self._pending is taken:
                self._pending = None

    def _switch(self, prompt, negative_prompt=None, embeds=None, negative_embeds=None, mode=None) -> None:
        positive, negative = self._prompts.switch(prompt, negative_prompt, embeds, negative_embeds)
        self.session.switch_prompt(positive, negative, mode=mode or self._switch_mode)

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="causal-wan-decode")
        return self._executor

    @torch.no_grad()
    def _decode(self, latents: torch.Tensor):
        if self._decoder is None:
            return None
        if not self._overlap or latents.device.type != "cuda":
            return self._processor.postprocess_video(self._decoder.decode(latents), self._output_type)
        side = torch.cuda.Stream(latents.device)  # beside the default stream, where the next chunk runs
        side.wait_stream(torch.cuda.default_stream(latents.device))  # the latents are written
        with torch.cuda.stream(side):
            video = self._decoder.decode(latents)
            return self._processor.postprocess_video(video, self._output_type)


def check_switch(mode: str, can_recache: bool) -> None:
    """Refuse a prompt switch the stream cannot make, when it is asked for (not when it is reached)."""
    if mode not in SWITCH_MODES:
        raise ValueError(f"prompt switch mode must be 'recache' or 'cross', got {mode!r}.")
    if mode == "recache" and not can_recache:
        raise NotImplementedError(
            "a 'recache' prompt switch re-caches text-conditioned streams only (an I2V or VACE stream's window "
            "inputs are not kept); switch it with mode='cross' (prompt_switch='cross')."
        )
