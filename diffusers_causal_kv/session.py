"""The rollout session: the one owner of a rollout's state.

A :class:`RolloutSession` is built once per ``pipe(...)`` call, per stream, per Modular denoise step and per
:func:`~diffusers_causal_kv.causal_rollout`, and holds everything the rollout needs until it ends:

* its :class:`~diffusers_causal_kv.RolloutPlanner` (the transformers, their engines, guidance, the conditioning as
  read-only values, and the :class:`~diffusers_causal_kv.noise.NoiseSource`);
* its :class:`Sampling` (few-step sigmas or a private copy of a diffusers scheduler, the commit's noise);
* its chunk plan (the sizes still to make) and where the video stands (chunks made, the next frame);
* for streams, the clean latents of the frames its cache holds (for a re-cache on a prompt switch), and the write
  stamps of its engines after its own last write, so a write by another caller is refused rather than continued on.

Nothing is read later from a pipeline's or another object's attributes. A prompt switch replaces the planner by one
with new conditioning (:meth:`RolloutSession.switch_prompt`), so no other holder sees a change.

Retries: a chunk whose forward raised keeps its place in the plan, its inputs and its noise; the next
:meth:`RolloutSession.step` runs it again from the same random state, so the video has every chunk exactly once and
equals an undisturbed rollout bit for bit (commits are atomic, so the failed attempt left the cache as it was).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from .causal_config import DEFAULTS, SAMPLERS
from .model import topology
from .parallel import check_ranks_agree
from .planner import Chunk, RolloutPlanner, check_context_noise
from .refill import adopt, planner_engines, recached_engines


def shifted_sigmas(timesteps: Sequence[float], shift: float = 1.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Flow-matching noise levels of a few-step timestep list, warped by the timestep ``shift`` as Self-Forcing does
    (``sigma = shift * s / (1 + (shift - 1) * s)`` with ``s = t / num_train_timesteps``)."""
    if len(timesteps) == 0:
        raise ValueError("timesteps is empty; pass at least one timestep per chunk, e.g. (1000, 750, 500, 250).")
    s = torch.as_tensor(timesteps, dtype=torch.float64) / num_train_timesteps
    if (s <= 0).any() or (s > 1).any():
        raise ValueError(f"timesteps must lie in (0, {num_train_timesteps}], got {list(timesteps)}.")
    return (shift * s / (1 + (shift - 1) * s)).float()


@dataclass(frozen=True)
class Sampling:
    """How every chunk of a session is denoised and committed.

    ``sigmas``: few-step noise levels (predict x0 at each, re-noise to the next); or ``scheduler`` with
    ``num_inference_steps``: a diffusers flow-matching scheduler, reset for every chunk (the session's own copy).
    ``context_noise`` / ``context_noise_mode``: the commit pass's timestep label and whether the clean chunk is first
    noised to it. ``sampler``: ``"chunkwise"`` (this module's :class:`RolloutSession`) or ``"rolling_forcing"``
    (:class:`~diffusers_causal_kv.rolling_forcing.RollingForcingSession`, few-step sigmas only). ``first_sigmas``:
    the few-step noise levels of a session's first chunk, when they differ (Causal-Forcing++)."""

    sigmas: tuple[float, ...] | None
    scheduler: object | None = None
    num_inference_steps: int | None = None
    context_noise: float = 0.0
    context_noise_mode: str = "label"
    sampler: str = DEFAULTS.sampler
    first_sigmas: tuple[float, ...] | None = None

    @classmethod
    def create(cls, timesteps: Sequence[float] = DEFAULTS.timesteps, shift: float = DEFAULTS.shift,
               context_noise: float = DEFAULTS.context_noise, context_noise_mode: str = DEFAULTS.context_noise_mode,
               scheduler=None, num_inference_steps: int | None = None, sampler: str = DEFAULTS.sampler,
               first_chunk_timesteps: Sequence[float] | None = None) -> Sampling:
        """Validated settings; a scheduler is copied, so another call on the same pipeline cannot reset it."""
        check_context_noise(context_noise, context_noise_mode)
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {list(SAMPLERS)}, got {sampler!r}.")
        if scheduler is not None:
            if not num_inference_steps:
                raise ValueError("scheduler sampling needs num_inference_steps (the steps per chunk).")
            if sampler != "chunkwise" or first_chunk_timesteps is not None:
                raise ValueError("scheduler sampling (num_inference_steps) runs every chunk alike; the "
                                 "'rolling_forcing' sampler and first_chunk_timesteps take few-step timesteps: drop "
                                 "num_inference_steps / scheduler, or sampler='rolling_forcing' / "
                                 "first_chunk_timesteps.")
            return cls(None, copy.deepcopy(scheduler), num_inference_steps, context_noise, context_noise_mode)
        first = None if first_chunk_timesteps is None else tuple(shifted_sigmas(first_chunk_timesteps, shift).tolist())
        return cls(tuple(shifted_sigmas(timesteps, shift).tolist()), None, None, context_noise, context_noise_mode,
                   sampler, first)

    def first_chunk(self) -> Sampling:
        """The sampling of a session's first chunk (``first_sigmas`` when given)."""
        return self if self.first_sigmas is None else replace(self, sigmas=self.first_sigmas)

    @property
    def steps(self) -> int:
        """Denoising steps per chunk."""
        if self.scheduler is None:
            return len(self.sigmas)
        self.scheduler.set_timesteps(self.num_inference_steps)
        return len(self.scheduler.timesteps)


def denoise_chunk(planner: RolloutPlanner, x: torch.Tensor, chunk: Chunk, sampling: Sampling,
                  on_step: Callable[[int, float, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The clean chunk sampled from noise ``x`` by ``sampling``.

    ``on_step(step, t, x)``, when given, runs after every denoising step with the step's index in the chunk, its
    timestep and the chunk's latents after it (the re-noised latents, or the clean chunk after the last step); what
    it returns replaces them."""
    if sampling.scheduler is None:
        sigmas = sampling.sigmas
        for i, sigma in enumerate(sigmas):
            x0 = planner.predict_x0(x, sigma, chunk)
            x = planner.renoise(x0, sigmas[i + 1]) if i + 1 < len(sigmas) else x0
            if on_step is not None:
                x = on_step(i, sigma * 1000, x)
        return x
    scheduler = sampling.scheduler
    scheduler.set_timesteps(sampling.num_inference_steps, device=x.device)
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(planner.flow(x, t, chunk), t, x, return_dict=False)[0]
        if on_step is not None:
            x = on_step(i, float(t), x)
    return x


@dataclass(frozen=True)
class SessionChunk:
    """A chunk a session made: its index, its place in the cache, its clean latents and its seconds."""

    index: int
    chunk: Chunk
    latents: torch.Tensor
    seconds: float


class RolloutSession:
    """One rollout: see the module docstring.

    Args:
        planner: the forwards (transformers, engines, guidance, conditioning, noise source).
        sampling: how each chunk is denoised and committed.
        sizes: the chunk plan, latent frames per chunk (an endless iterable for an open-ended stream).
        latent_shape: ``(batch, channels, height, width)`` of the latents; with ``device``, where noise is drawn
            (``None`` when every chunk's inputs bring their ``"noise"``).
        chunk_inputs: ``(start_frame, size) -> dict`` of the chunk's per-frame inputs (``condition_latents``,
            ``control_latents``), optionally ``"noise"`` (the chunk's initial latents, instead of a draw) and
            ``"start"`` (a map from the drawn noise to the initial latents, video-to-video). ``None``: the planner's
            own per-frame inputs, which cover the session's frames from its first one.
        keep_window: keep the clean latents of the frames the cache holds (needed to re-cache on a prompt switch);
            ``recache_frames``: the most frames per commit pass of such a re-cache.
        latents: the initial latents of every frame of the plan (``[batch, channels, frames, h, w]``), instead of
            drawing each chunk's noise.
        continue_cache: start where the planner's engines are instead of clearing them.

    A finite plan (a list of sizes) is checked whole before anything is cleared: inputs the model refuses, a
    schedule an engine cannot hold, positions past the RoPE table. Each chunk is checked again before it runs.
    """

    sampler = "chunkwise"
    """The :attr:`Sampling.sampler` this class runs (a subclass runs another)."""

    def __init__(self, planner: RolloutPlanner, sampling: Sampling, *, sizes: Iterable[int],
                 latent_shape: Sequence[int] | None = None, device: torch.device | None = None,
                 chunk_inputs: Callable | None = None,
                 keep_window: bool = False, recache_frames: int = 3, latents: torch.Tensor | None = None,
                 continue_cache: bool = False) -> None:
        if sampling.sampler != self.sampler:
            raise ValueError(f"{type(self).__name__} runs the {self.sampler!r} sampler, not {sampling.sampler!r}; "
                             "build the session with diffusers_causal_kv.make_session().")
        check_ranks_agree(planner, sampling, sizes, latent_shape, latents, device)  # before any check can diverge
        self.planner, self.sampling = planner, sampling
        self.latent_shape, self.device = latent_shape and tuple(latent_shape), device
        if latent_shape is not None:
            self.planner.noise.check_batch(latent_shape[0])
        # A whole plan whose inputs the planner holds is checked here once; chunks that bring their inputs each.
        self._checked_whole = isinstance(sizes, Sequence) and chunk_inputs is None
        if isinstance(sizes, Sequence):  # the whole plan, before anything is cleared
            frames = planner.next_frame() if continue_cache else 0
            if chunk_inputs is None:
                template = latents if latents is not None else torch.zeros(
                    (*self.latent_shape[:2], sum(sizes), *self.latent_shape[2:]), device=device)
                planner.check(template, planner.plan(template, list(sizes), frames))
            else:  # the inputs come chunk by chunk: the schedule now, the inputs per chunk
                planner.check_schedule(frames, list(sizes))
        self._sizes, self._next_size, self._latents = iter(sizes), None, latents
        self._chunk_inputs, self._keep_window, self.recache_frames = chunk_inputs, keep_window, recache_frames
        kind, config = topology(planner.transformer), planner.transformer.config
        self.text_only = not (kind.is_vace or kind.is_i2v or config.in_channels != config.out_channels)
        self._window: list[tuple[int, torch.Tensor]] = []
        self._pending: tuple | None = None  # a chunk prepared (inputs, noise) but not committed yet
        self.index = 0
        planner.prepare()  # the engine maps exist from here on: the write stamps follow them
        if not continue_cache:
            self.planner.clear()
        self.first_frame = self.planner.next_frame()
        self._stamps = self._read_stamps()

    # ------------------------------------------------------------------------------------------------ state
    @property
    def next_frame(self) -> int:
        """The absolute latent frame the next chunk starts at."""
        return self.planner.next_frame()

    @property
    def prompts(self):
        """The conditioning of each tag (read-only)."""
        return self.planner.prompts

    @property
    def engine(self):
        """The ``"main"`` engine of the first expert (``None`` before a forward created it)."""
        return self.engine_maps()[0].get("main")

    def engine_maps(self) -> list[dict]:
        """The engine map of every expert, in order."""
        return planner_engines(self.planner)

    def window(self) -> list[tuple[int, torch.Tensor]]:
        """``(start_frame, clean latents)`` of each range of frames the cache holds (``keep_window`` sessions)."""
        return list(self._window)

    def memory_bytes(self) -> int:
        """Bytes held by the engines and by the clean latents kept for re-caching."""
        held = sum(e.memory_bytes() for engines in self.engine_maps() for e in engines.values())
        return held + sum(t.nbytes for _, t in self._window)

    def peek_size(self) -> int | None:
        """Latent frames of the next chunk, or ``None`` when the plan is done."""
        if self._pending is not None:
            return self._pending[0].size
        if self._next_size is None:
            self._next_size = next(self._sizes, None)
        return self._next_size

    def replan(self, sizes: Iterable[int], chunk_inputs: Callable | None = None, keep_pending: bool = False) -> None:
        """Continue with another chunk plan (a resumed stream) or with other inputs (a :class:`StreamingRollout`'s
        ``generate``, given ``chunk_inputs``). A chunk that failed and was not made again is kept first with
        ``keep_pending`` (its inputs were drawn from the session's own feeds), else dropped and its random draws given
        back."""
        if not keep_pending:
            self._drop_pending()
        self._sizes, self._next_size, self._checked_whole = iter(sizes), None, False
        self._chunk_inputs = chunk_inputs if chunk_inputs is not None else self._chunk_inputs

    def _drop_pending(self) -> None:
        """Forget a chunk that failed and was not made again, giving back its random draws."""
        if self._pending is not None:
            self.planner.noise.restore(self._pending[4])
            self._pending = None

    @property
    def pending_frames(self) -> int:
        """Latent frames of a chunk that failed and will be made again first (0 when there is none)."""
        return 0 if self._pending is None else self._pending[0].size

    # ------------------------------------------------------------------------------------------------ chunks
    @torch.no_grad()
    def step(self, on_step: Callable[[Chunk, int, float, torch.Tensor], torch.Tensor] | None = None
             ) -> SessionChunk | None:
        """Denoise and commit the next chunk of the plan; ``None`` when the plan is done. ``on_step(chunk, step, t,
        x)`` runs after every denoising step (:func:`denoise_chunk`)."""
        self.check_unchanged()
        if self.peek_size() is None:
            return None
        if self._pending is None:
            self._pending = self._prepare(self._next_size)
            self._next_size = None
        chunk, x, inputs, random_state, _ = self._pending
        planner = self.planner if self._chunk_inputs is None else self.planner.with_frames(**inputs)
        planner.noise.restore(random_state)  # a retry draws what the failed attempt drew
        began = time.perf_counter()
        step = None if on_step is None else (lambda i, t, z: on_step(chunk, i, t, z))
        sampling = self.sampling.first_chunk() if self.index == 0 else self.sampling
        x = denoise_chunk(planner, x, chunk, sampling, step)
        x = planner.with_first_frame(x, chunk)  # TI2V image-to-video: frame 0 is the image
        self._commit(planner, x, chunk)
        _synchronize(x)
        self._pending = None
        if self._keep_window:
            self._remember(chunk.frame, x)
        self.index += 1
        return SessionChunk(self.index - 1, chunk, x, time.perf_counter() - began)

    @torch.no_grad()
    def prefill(self, latents: torch.Tensor, chunk_frames: int | Sequence[int], **per_frame: torch.Tensor | None
                ) -> None:
        """Continue with the given clean latents instead of generating (commit passes only), chunk by chunk, each
        kept at once; ``per_frame``: the I2V / VACE inputs of the same frames."""
        self.check_unchanged()
        self._drop_pending()  # a chunk that failed before would now start at a frame the clip takes
        planner = self.planner.with_frames(**per_frame)
        for chunk in planner.plan(latents, chunk_frames, self.next_frame, given="latents"):
            part = latents[:, :, chunk.offset:chunk.offset + chunk.size]
            self._commit(planner, part, chunk)
            if self._keep_window:
                self._remember(chunk.frame, part)

    def _commit(self, planner: RolloutPlanner, x: torch.Tensor, chunk: Chunk) -> None:
        """Commit a clean chunk on every tag, then take the stamps of this session's own write (also when it raised:
        an aborted commit moves stamps too)."""
        try:
            planner.commit(x, chunk, self.sampling.context_noise, self.sampling.context_noise_mode)
        finally:
            self._stamps = self._read_stamps()

    def __iter__(self):
        while (made := self.step()) is not None:
            yield made

    def _prepare(self, size: int, start: int | None = None) -> tuple:
        """The next chunk's place (``start``: its first frame, default where the cache continues), initial latents,
        per-frame inputs and random state; inputs and noise are drawn once, so that a retry reuses them."""
        start = self.planner.next_frame() if start is None else start
        before = self.planner.noise.state()
        inputs = {} if self._chunk_inputs is None else dict(self._chunk_inputs(start, size))
        noise, to_start = inputs.pop("noise", None), inputs.pop("start", None)
        if noise is None and self._latents is not None:
            noise = self._latents[:, :, start - self.first_frame:start - self.first_frame + size]
        if noise is None:
            noise = self.planner.noise.initial((*self.latent_shape[:2], size, *self.latent_shape[2:]), self.device)
        x = noise if to_start is None else to_start(noise)
        if self._chunk_inputs is None:  # the planner's per-frame inputs cover the session's frames
            planner, chunk = self.planner, Chunk(start - self.first_frame, size, start)
        else:
            planner = self.planner.with_frames(**inputs)
            chunk = planner.plan(x, [size], start)[0]
        if not self._checked_whole:
            planner.check(x, [chunk])
        return chunk, x, inputs, planner.noise.state(), before

    # ------------------------------------------------------------------------------------------------ prompts
    @property
    def can_recache(self) -> bool:
        """Whether :meth:`switch_prompt` may re-cache: text-conditioned sessions that keep their window (the
        window's I2V/VACE inputs are not kept)."""
        return self._keep_window and self.text_only

    def switch_prompt(self, prompt_embeds: torch.Tensor | None, negative_prompt_embeds: torch.Tensor | None = None,
                      mode: str = "recache") -> None:
        """Use new conditioning from the next chunk on: the planner's tag, and ``"neg"`` too when guidance runs and
        a new negative prompt is given (otherwise the negative prompt is kept).

        ``mode="recache"`` (LongLive) re-caches the window under the new prompts, so the next chunks attend to
        frames whose K/V were computed under them; ``mode="cross"`` only swaps the cross-attention entries: the
        cached frames keep the K/V of the old prompt. Every new tag is built before any is swapped in."""
        if mode not in ("recache", "cross"):
            raise ValueError(f"prompt switch mode must be 'recache' or 'cross', got {mode!r}.")
        self.check_unchanged()
        new = {} if prompt_embeds is None else {self.planner.cache_tag: prompt_embeds}
        if negative_prompt_embeds is not None and "neg" in self.planner.prompts:
            new["neg"] = negative_prompt_embeds
        filled = [tag for tag in new if any(tag in e.tags() for m in self.engine_maps() for e in m.values())]
        if mode == "recache" and filled:
            if not self.can_recache:
                raise NotImplementedError(
                    "a re-cache prompt switch re-caches text-conditioned streams only (the window's I2V/VACE inputs "
                    "are not kept); switch an I2V or VACE stream with mode='cross'."
                )
            random_state = self.planner.noise.state()  # a re-cache that raised is made again with the same draws
            try:
                built = {tag: recached_engines(self.planner, self._window, tag, new[tag], self.recache_frames,
                                               self.sampling.context_noise, self.sampling.context_noise_mode)
                         for tag in filled}
            except BaseException:
                self.planner.noise.restore(random_state)
                raise
            try:
                for tag, scratch in built.items():
                    adopt(self.planner, scratch, tag)
            finally:
                self._stamps = self._read_stamps()
        elif mode == "cross":
            for tag in filled:
                for engine in (e for m in self.engine_maps() for e in m.values() if tag in e.tags()):
                    engine.reset_conditioning(tag)
            self._stamps = self._read_stamps()
        self.planner = self.planner.with_prompts(**new)

    # ------------------------------------------------------------------------------------------------ guards
    def check_unchanged(self) -> None:
        """Refuse to continue if another caller wrote this session's engines since its own last write."""
        if self._read_stamps() != self._stamps:
            raise RuntimeError(
                "this rollout's KV cache was written by another caller since its last chunk (a pipe(...) call, "
                "another stream or rollout on the same engines, clear_caches or a crop); its frames no longer "
                "continue this video. Start a new stream, and give each concurrent rollout engines of its own "
                "(cache_engines=)."
            )

    def _read_stamps(self) -> list[tuple[int, int]]:
        return [(id(engine), engine.write_stamp(tag)) for engines in self.engine_maps()
                for engine in engines.values() for tag in self.planner.prompts]

    def _remember(self, start: int, latents: torch.Tensor) -> None:
        """Add clean latents of frames ``start...`` and drop those of frames the cache no longer holds."""
        pieces = [*self._window, (start, latents)]
        held = self.engine_maps()[0]["main"].held_frames(self.planner.cache_tag)
        # Every held frame is among the pieces: the engines were written by this session alone (check_unchanged).
        self._window = [(r.start, torch.cat([t[:, :, max(r.start, s) - s:min(r.stop, s + t.shape[2]) - s]
                                             for s, t in pieces if s < r.stop and r.start < s + t.shape[2]], dim=2))
                        for r in held]  # cat copies: the dropped frames' memory is released


def _synchronize(x: torch.Tensor) -> None:
    """Wait for the device, so that per-chunk seconds measure the chunk's work."""
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
