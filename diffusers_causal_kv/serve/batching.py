"""Cross-session batching: the next chunk of several live streams, their transformer forwards run as one batch.

:func:`step_streams` makes the next chunk of every stream, as ``next(stream)`` makes it, each stream in a worker
thread of its own. Every cached transformer forward a stream runs (denoising steps, guidance, commits, the re-cache of
a prompt switch) is handed to a rendezvous instead of running at once. When every stream still working waits with a
forward, the waiting forwards are grouped by their batch key (:meth:`~diffusers_causal_kv.model.gather.GatheredForward.
batch_key`: the same transformer, input shapes per row, shared arguments and temporal RoPE positions) and each group
runs as one forward, one group at a time, in the thread of its first stream. Sessions at the same denoising step of
chunks of one shape therefore share every forward of the chunk; the others run alongside, alone.

Why the rows are split where they are: a batch is split into row passes at the model layer, the way a batch of
guidance tags already is, so each row keeps its own engines, tags, start frame, conditioning, guidance, timesteps and
noise; engines and processors are unchanged. Attention runs per session over its own cache (the prefixes may differ
in length), so nothing is padded, masked or copied; only the RoPE table is one per forward, so sessions are grouped by
their chunk's positions: under absolute positions only sessions at the same frame share a forward; a rolling window
with relative positions numbers every full window alike, so at steady state every session of one chunk size does.

Ownership and failures: each stream's session owns its state; the rendezvous only runs forwards. Everything a stream
does before and after a forward (its inputs, noise, guidance, prompt switch, commit) runs in its own thread, as it
would alone: a forward is validated there before it is handed over, and each session commits its own rows, atomically
(its own ``commits_together``). A batch that raises is run again row by row, each session alone, so an error belongs
to the session whose forward raises alone; its chunk stays pending (as after any failed step) and the others go on.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ambient import gathering
from ..model.gather import GatheredForward, run_together
from ..pipelines.stream import CausalWanStream, StreamChunk


def step_streams(streams: Sequence[CausalWanStream], *, batched: bool = True
                 ) -> list[StreamChunk | BaseException | None]:
    """Make the next chunk of every stream; per stream, in order: its :class:`StreamChunk`, the exception its step
    raised (the chunk stays pending: iterating again makes it again), or ``None`` when it is exhausted (or closed).

    ``batched=False`` is ``next(stream)`` for each stream in turn. ``batched=True`` runs the same steps together, the
    forwards that can share a batch as one (see the module docstring); each stream's latents equal those it makes
    alone to float rounding (the model computes a row of a batch in another order than the row alone; ``<= 1e-5`` in
    fp32 in the tests). The caller's inference and autocast modes apply to every stream, as they would to ``next``.

    The streams must not share engines (each ``pipe.stream`` makes its own unless ``cache_engines`` is given)."""
    streams = list(streams)
    _check_streams(streams)
    if not batched or len(streams) < 2:
        return [_next(stream) for stream in streams]
    rendezvous = _Rendezvous(len(streams))
    results: list = [None] * len(streams)
    modes = _caller_modes()

    def work(i: int) -> None:
        try:
            with modes(), gathering(rendezvous):
                results[i] = _next(streams[i])
        finally:
            rendezvous.leave()

    # Each worker starts from a copy of the caller's context variables (open contexts, guidance ranks, ...).
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(work, i), name=f"causal-wan-step-{i}")
               for i in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _caller_modes():
    """The caller's thread-local torch modes (gradients, inference mode, autocast), to enter again in a worker
    thread, where torch starts from its defaults."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocasts = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device)]

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(torch.inference_mode(inference))
        for device, dtype in autocasts:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        return stack

    return enter


def _next(stream: CausalWanStream) -> StreamChunk | BaseException | None:
    try:
        return next(stream)
    except StopIteration:
        return None
    except BaseException as error:  # the stream's own outcome, handed back in its place
        return error


def _check_streams(streams: list) -> None:
    """Refuse, before any work, what one step of several streams cannot do: a stream given twice, or two streams
    writing the same tag of the same engine (their chunks would both continue it)."""
    for stream in streams:
        if not isinstance(stream, CausalWanStream):
            raise TypeError(f"step_streams takes streams made by CausalWanPipeline.stream(), got "
                            f"{type(stream).__name__}.")
    if len({id(s) for s in streams}) != len(streams):
        raise ValueError("step_streams got the same stream twice; pass each stream once (one chunk per stream "
                         "per step).")
    writers: dict[tuple[int, str], int] = {}
    for index, stream in enumerate(streams):
        session = stream.session
        for engine in {id(e): e for m in session.engine_maps() for e in m.values()}.values():
            for tag in session.prompts:
                other = writers.setdefault((id(engine), tag), index)
                if other != index:
                    raise ValueError(
                        f"streams {other} and {index} write cache tag {tag!r} of the same {type(engine).__name__}; "
                        "give each stream engines of its own (drop cache_engines=, or pass a new map per stream)."
                    )


@dataclass(eq=False)
class _Ticket:
    """A forward waiting at the rendezvous, and what became of it."""

    forward: GatheredForward
    key: tuple | None
    group: list | None = None
    output: object = None
    done: bool = False
    alone: bool = False  # its batch raised: run it by itself


class _Rendezvous:
    """Where the worker threads of one :func:`step_streams` call hand their forwards (the ``gathering`` protocol: a
    call with a :class:`GatheredForward` returns its output). A round closes when every worker still running waits
    with a forward; its forwards are grouped by batch key, and each group runs in its first forward's thread, one
    group at a time (the device runs one forward at a time anyway)."""

    def __init__(self, workers: int) -> None:
        self._state = threading.Condition()
        self._running = workers
        self._waiting: list[_Ticket] = []
        self._device = threading.Lock()

    def __call__(self, forward: GatheredForward):
        ticket = _Ticket(forward, forward.batch_key())
        with self._state:
            self._waiting.append(ticket)
            self._close_round()
            self._state.wait_for(lambda: ticket.group is not None)
        if ticket.group[0] is ticket:
            self._lead(ticket.group)
        with self._state:
            self._state.wait_for(lambda: ticket.done)
        if ticket.alone:
            with self._device:
                return forward.run_alone()
        return ticket.output

    def leave(self) -> None:
        """A worker finished its stream's step."""
        with self._state:
            self._running -= 1
            self._close_round()

    def _close_round(self) -> None:
        if not self._waiting or len(self._waiting) < self._running:
            return
        groups: dict = {}
        for ticket in self._waiting:
            groups.setdefault(id(ticket) if ticket.key is None else ticket.key, []).append(ticket)
        for group in groups.values():
            for ticket in group:
                ticket.group = group
        self._waiting = []
        self._state.notify_all()

    def _lead(self, group: list[_Ticket]) -> None:
        """Run a group's forwards as one; a forward with nothing to share, or whose batch raised, is then run alone
        in its own thread (so its error, if any, is raised there)."""
        outputs = None
        if len(group) > 1:
            try:
                with self._device:
                    outputs = run_together([t.forward for t in group])
            except BaseException:  # whose rows failed is found by running each alone
                outputs = None
        with self._state:
            for i, ticket in enumerate(group):
                ticket.alone = outputs is None
                ticket.output = None if outputs is None else outputs[i]
                ticket.done = True
            self._state.notify_all()
