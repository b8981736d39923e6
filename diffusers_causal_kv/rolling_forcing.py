"""The Rolling Forcing sampler (TencentARC, arXiv 2509.25161): chunks denoised jointly in a staggered window.

With ``K`` few-step timesteps ``t_0 > t_1 > ... > t_{K-1}``, the window holds up to ``K`` consecutive chunks, the
oldest at the lowest noise level and each later one a step noisier, the newest at ``t_0`` (pure noise when it
enters). One window forward, with one timestep per latent frame, predicts the clean latents of every chunk in it;
then, chunk by chunk in window order, every chunk not yet at its last step is re-noised to its next timestep with a
fresh draw of the whole window's shape (the reference draws it so: one ``randn_like`` of the window per chunk, laid
out ``[batch, frames, channels, height, width]``, of which the chunk's frames are kept), and the oldest chunk, once
at its last step, is finished: it is emitted, committed into the cache at ``context_noise`` like any chunk, and the
window slides by one chunk. At the start the window grows one chunk per forward (warm-up, ``K - 1`` forwards that
finish nothing), at the end it shrinks (tail), so every chunk passes through every timestep exactly once.

Each window forward is one cached pass through the session's engines, starting at the first frame the cache does
not hold yet: the window attends to the committed clean frames the engine offers (all of them, or with a
:class:`~diffusers_causal_kv.RollingKVCacheEngine` the sink and the most recent frames, ``window_frames`` in all,
the window itself included) and, inside itself, every frame to every frame. Rolling Forcing's release keeps the
first chunk as its sink and attends over 21 latent frames with the sink re-indexed next to the recent frames:
``window_frames=21, sink_frames=3, positions="relative"``.

Schedule read in TencentARC's ``pipeline/rolling_forcing_inference.py`` (``inference_rolling_forcing``; in the fork
sk4161/RollingForcing at commit d8f7bcaf51abee8fec8ad26ca85b8c93a190634e) and its model's cache in
``wan/modules/causal_model.py`` (``CausalWanSelfAttention``; in zengqunzhao/Relax-Forcing's copy
``wan/modules/rolling_forcing_model.py`` at commit 6d2b4fa57da381a4461490ec7c34bb150bc338ba). The reference
re-commits the window's first chunk after every warm-up forward too; those commits are overwritten before any pass
reads them (a window at frame 0 attends to itself only), so only finished chunks are committed here. One difference
is left: once its clean cache holds more than 21 frames, the reference's commit pass reads the 21 most recent
frames without the sink (its buffer's last 21 of 24 frames), while every pass here reads the engine's window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .model import topology
from .planner import Chunk, RolloutPlanner
from .session import RolloutSession, Sampling, SessionChunk, _synchronize


@dataclass(frozen=True)
class _InFlight:
    """A chunk in the window: its place, its latents at the noise level of step ``step``, its per-frame inputs and
    the random state before it was drawn."""

    chunk: Chunk
    latents: torch.Tensor
    step: int
    inputs: dict
    before: list


class RollingForcingSession(RolloutSession):
    """A :class:`~diffusers_causal_kv.RolloutSession` that samples with Rolling Forcing (see the module docstring).

    It takes the arguments of :class:`~diffusers_causal_kv.RolloutSession`, with ``sampling.sampler ==
    "rolling_forcing"`` and few-step ``sampling.sigmas``. :meth:`step` returns the next finished chunk (the first call
    runs the ``K - 1`` warm-up forwards too). A window forward or commit that raised changes nothing: the next
    :meth:`step` runs it again with the same random draws.
    """

    sampler = "rolling_forcing"

    def __init__(self, planner: RolloutPlanner, sampling: Sampling, *, sizes, **kwargs) -> None:
        if sampling.sigmas is None or sampling.first_sigmas is not None:
            raise ValueError("the 'rolling_forcing' sampler runs one list of few-step timesteps for every chunk (its "
                             "window holds one chunk per timestep); drop num_inference_steps / scheduler / "
                             "first_chunk_timesteps, or use sampler='chunkwise'.")
        if len(planner.experts) > 1 or topology(planner.transformer).is_vace:
            raise NotImplementedError(
                "the 'rolling_forcing' sampler runs one timestep per latent frame, which a two-expert Wan2.2 A14B "
                "model (one expert per timestep) and the VACE transformer (one timestep per sample) do not take; "
                "use sampler='chunkwise' for them."
            )
        steps = len(sampling.sigmas)
        if isinstance(sizes, Sequence) and len(sizes):  # the widest window must fit the engines, before any clearing
            sizes = list(sizes)
            widest = max(sum(sizes[i:i + steps]) for i in range(len(sizes)))
            first = planner.next_frame() if kwargs.get("continue_cache") else 0
            planner.check_schedule(first, [widest])
        super().__init__(planner, sampling, sizes=sizes, **kwargs)
        self.steps = steps
        self._inflight: list[_InFlight] = []
        self._window_noise: list | None = None  # random state of the window forward in progress (for a retry)

    @property
    def pending_frames(self) -> int:
        """Latent frames in the window, begun but not finished (made first by a resumed stream)."""
        return sum(c.chunk.size for c in self._inflight)

    def peek_size(self) -> int | None:
        """Latent frames of the next chunk :meth:`step` returns (the oldest in the window), or ``None`` when the plan
        is done."""
        return self._inflight[0].chunk.size if self._inflight else super().peek_size()

    def _drop_pending(self) -> None:
        """Forget the chunks in the window, giving back their random draws."""
        if self._inflight:
            self.planner.noise.restore(self._inflight[0].before)
            self._inflight, self._window_noise = [], None

    @torch.no_grad()
    def step(self, on_step: Callable[[Chunk, int, float, torch.Tensor], torch.Tensor] | None = None
             ) -> SessionChunk | None:
        """Run window forwards until the oldest chunk is finished, commit it and return it; ``None`` when the plan is
        done. ``on_step(chunk, step, t, x)`` runs for every chunk of every window forward, with the chunk's latents
        after it (re-noised to its next level, or clean after its last step)."""
        self.check_unchanged()
        began = time.perf_counter()
        while True:
            if self._window_noise is None:  # a new window forward: take the next chunk in, if there is room
                if len(self._inflight) < self.steps and super().peek_size() is not None:
                    self._admit()
                if not self._inflight:
                    return None
                self._window_noise = self.planner.noise.state()
            self.planner.noise.restore(self._window_noise)  # a retry draws what the failed attempt drew
            finished = self._window_forward(on_step)
            self._window_noise = None
            if finished is not None:
                chunk, x = finished
                if self._keep_window:
                    self._remember(chunk.frame, x)
                self.index += 1
                return SessionChunk(self.index - 1, chunk, x, time.perf_counter() - began)

    def _admit(self) -> None:
        """Draw the next chunk's noise and inputs (once) and put it at the noisy end of the window."""
        last = self._inflight[-1].chunk if self._inflight else None
        start = self.planner.next_frame() if last is None else last.frame + last.size
        chunk, x, inputs, _, before = self._prepare(self._next_size, start)
        self._next_size = None
        self._inflight = [*self._inflight, _InFlight(chunk, x, 0, inputs, before)]

    def _window_forward(self, on_step) -> tuple[Chunk, torch.Tensor] | None:
        """One forward over the window; the window's new state is kept only once the finished chunk (if any) is
        committed."""
        window = self._inflight
        planner, chunk = self._window_planner(window)
        sigmas = self.sampling.sigmas
        frame_sigmas = torch.tensor([sigmas[c.step] for c in window for _ in range(c.chunk.size)])
        # timesteps as the chunkwise sampler hands them over: sigma * 1000 in double precision, then float32
        frame_steps = torch.tensor([sigmas[c.step] * 1000 for c in window for _ in range(c.chunk.size)])
        x = torch.cat([c.latents for c in window], dim=2)
        flow = planner.flow(x, frame_steps, chunk)
        x0 = x - frame_sigmas.to(x.device)[None, None, :, None, None] * flow
        kept, finished, offset = [], None, 0
        for c in window:
            part = x0[:, :, offset:offset + c.chunk.size]
            if c.step + 1 == self.steps:  # the oldest chunk, at its last step: finished, no draw
                part = planner.with_first_frame(part, c.chunk)  # TI2V image-to-video: frame 0 is the image
                finished = (c, _after(on_step, c, sigmas[c.step], part))
            else:
                noise = planner.noise.like(x0.transpose(1, 2)).transpose(1, 2)[:, :, offset:offset + c.chunk.size]
                sigma = sigmas[c.step + 1]
                renoised = (1 - sigma) * part + sigma * noise
                kept.append(replace(c, latents=_after(on_step, c, sigmas[c.step], renoised), step=c.step + 1))
            offset += c.chunk.size
        if finished is not None:
            c, x = finished
            self._commit(self.planner if self._chunk_inputs is None else self.planner.with_frames(**c.inputs),
                         x, c.chunk)
            _synchronize(x)
        self._inflight = kept
        return None if finished is None else (finished[0].chunk, finished[1])

    def _window_planner(self, window: list[_InFlight]) -> tuple[RolloutPlanner, Chunk]:
        """The planner and the chunk of one window forward (the frames of every chunk in it)."""
        first, frames = window[0].chunk, sum(c.chunk.size for c in window)
        if self._chunk_inputs is None:  # the planner's per-frame inputs cover the session's frames
            return self.planner, Chunk(first.offset, frames, first.frame)
        inputs = {name: None if window[0].inputs[name] is None else torch.cat([c.inputs[name] for c in window], 2)
                  for name in window[0].inputs}
        return self.planner.with_frames(**inputs), Chunk(0, frames, first.frame)


def _after(on_step, c: _InFlight, sigma: float, x: torch.Tensor) -> torch.Tensor:
    return x if on_step is None else on_step(c.chunk, c.step, sigma * 1000, x)


def make_session(planner: RolloutPlanner, sampling: Sampling, **kwargs) -> RolloutSession:
    """The session that runs ``sampling.sampler``: a :class:`RollingForcingSession` for ``"rolling_forcing"``, else
    a :class:`~diffusers_causal_kv.RolloutSession`; ``kwargs`` are theirs."""
    cls = RollingForcingSession if sampling.sampler == RollingForcingSession.sampler else RolloutSession
    return cls(planner, sampling, **kwargs)
