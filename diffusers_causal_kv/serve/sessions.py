"""The session table and the one thread that runs it.

A :class:`SessionLoop` owns the pipeline and every live session. Clients never touch either: their checked requests
(:mod:`.protocol`) are queued as commands, and the loop's thread takes them between chunks, then makes the next chunk
of every live session in one :func:`~diffusers_causal_kv.serve.batching.step_streams` call. So the table changes in
one thread only, a start, switch or stop takes effect before the next chunk, and a session that ends (stopped,
finished, failed, idle, or its client gone) is closed and dropped before that chunk: its cache is freed as soon as
the chunk in flight returns.

Frames go out through each client's :class:`Client` ``post_chunk``, which never blocks the loop (the app's mailbox
drops a slow client's oldest queued chunk; see :mod:`.app`).
"""

from __future__ import annotations

import io
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..masks import chunk_schedule
from .admission import retry_hint, session_cache_bytes
from .batching import step_streams
from .protocol import StartRequest, StopRequest, SwitchRequest, error_message


class Client(Protocol):
    """Where a session's messages go; every method is called from the loop's thread and must not block."""

    def post(self, message: dict) -> None: ...

    def post_chunk(self, header: dict, frames: list[bytes]) -> None: ...

    def idle_seconds(self) -> float:
        """Seconds the client has left messages waiting unread (0 when it keeps up)."""


@dataclass
class Session:
    id: str
    client: Client
    stream: object
    cache_bytes: int
    chunks_left: int | None
    prompts: list[tuple[int, str]]
    """``(first chunk, prompt)``: the prompt each chunk is made with, from that chunk on."""
    made: int = 0

    def prompt_of(self, index: int) -> str:
        return [prompt for first, prompt in self.prompts if first <= index][-1]


class SessionLoop:
    """Runs every session of one pipeline on one thread.

    Args:
        pipe: a :class:`~diffusers_causal_kv.CausalWanPipeline` this loop alone uses from now on.
        budget: bytes the sessions' caches may hold together (:func:`.admission.session_cache_bytes` each).
        max_sessions: sessions at once.
        batched: make the chunks of all sessions in batched forwards (else one session after another).
        idle_timeout: seconds a client may leave frames unread before its session is ended.
        name: this server's name, the prefix of its session ids (a Ray Serve replica's id).
    """

    def __init__(self, pipe, budget: int, *, max_sessions: int = 8, batched: bool = True, idle_timeout: float = 60.0,
                 name: str = "local") -> None:
        self.pipe, self.budget, self.max_sessions, self.batched = pipe, budget, max_sessions, batched
        self.idle_timeout, self.name = idle_timeout, name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[Client, Session] = {}
        self._lock = threading.Lock()  # snapshot() reads the table from other threads
        self._ids = itertools.count(1)
        self._step_seconds: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="causal-wan-sessions", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """End every session and stop the thread."""
        if self._thread is not None:
            self._commands.put(("quit", None, None))
            self._thread.join()
            self._thread = None

    def submit(self, client: Client, request: StartRequest | SwitchRequest | StopRequest) -> None:
        """Queue a checked request of ``client``; its answer is posted to the client."""
        self._commands.put(("request", client, request))

    def disconnect(self, client: Client) -> None:
        """``client`` is gone: its session (if any) ends before the next chunk, without a message."""
        self._commands.put(("gone", client, None))

    def snapshot(self) -> dict[str, dict]:
        """The live sessions: ``{id: {"prompt", "chunks", "cache_bytes"}}`` (a copy, safe from any thread)."""
        with self._lock:
            return {s.id: {"prompt": s.prompts[-1][1], "chunks": s.made, "cache_bytes": s.cache_bytes}
                    for s in self._sessions.values()}

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.cache_bytes for s in self._sessions.values())

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            commands = [self._commands.get()] if not self._sessions else []  # nothing to make: wait for a client
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for kind, client, request in commands:
                if kind == "quit":
                    for session in list(self._sessions.values()):
                        self._end(session, {"type": "stopped", "chunks": session.made, "reason": "server shutdown"})
                    return
                try:
                    self._handle(kind, client, request)
                except Exception as error:  # e.g. out of memory encoding a prompt: this request fails, not the loop
                    client.post(error_message("session_failed", f"the server could not take this request: "
                                              f"{type(error).__name__}: {error}"))
            self._end_idle()
            if self._sessions:
                self._step()

    def _handle(self, kind: str, client: Client, request) -> None:
        session = self._sessions.get(client)
        if kind == "gone":
            if session is not None:
                self._end(session, None)
        elif isinstance(request, StartRequest):
            client.post(self._start(client, request))
        elif session is None:
            client.post(error_message("not_streaming", "this connection has no session; send a 'start' message "
                                      "first."))
        elif isinstance(request, SwitchRequest):
            client.post(self._switch(session, request))
        else:
            self._end(session, {"type": "stopped", "chunks": session.made})

    def _start(self, client: Client, request: StartRequest) -> dict:
        """Admit a session, or refuse it (a reply that changes nothing)."""
        if client in self._sessions:
            return error_message("already_streaming", "this connection already streams a session; send 'stop' "
                                 "first.")
        if len(self._sessions) >= self.max_sessions:
            hint, wait = retry_hint(1, 1, [(1, self._seconds_left(s)) for s in self._sessions.values()])
            return error_message("too_many_sessions", f"the server runs its maximum of {self.max_sessions} "
                                 f"sessions; {hint}", wait)
        try:
            stream = self.pipe.stream(
                prompt=request.prompt, negative_prompt=request.negative_prompt, height=request.height,
                width=request.width, num_frames=request.num_frames, chunk_frames=request.chunk_frames,
                guidance_scale=request.guidance_scale, generator=torch.Generator().manual_seed(request.seed),
                output_type="pil", prompt_switch=request.prompt_switch, overlap=False)
        except (ValueError, TypeError, NotImplementedError) as error:  # settings this model refuses
            return error_message("bad_value", f"the model refuses these settings: {error}")
        need = session_cache_bytes(stream)
        held = sum(s.cache_bytes for s in self._sessions.values())
        if held + need > self.budget:
            stream.close()
            hint, wait = retry_hint(need, self.budget, [(s.cache_bytes, self._seconds_left(s))
                                                        for s in self._sessions.values()])
            return error_message("over_budget", f"this session's cache needs {need} bytes; {held} of the budget of "
                                 f"{self.budget} are held by {len(self._sessions)} sessions. {hint}", wait)
        chunk = request.chunk_frames or self.pipe.causal_config.chunk_frames
        left = None if request.num_frames is None else len(chunk_schedule(
            (request.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1, chunk))
        session = Session(f"{self.name}-{next(self._ids)}", client, stream, need, left, [(0, request.prompt)])
        with self._lock:
            self._sessions[client] = session
        return {"type": "started", "session": session.id, "cache_bytes": need, "budget": self.budget,
                "held_bytes": held + need, "chunks": left, "height": request.height, "width": request.width}

    def _switch(self, session: Session, request: SwitchRequest) -> dict:
        try:
            session.stream.switch_prompt(request.prompt, request.negative_prompt, mode=request.mode)
        except (ValueError, NotImplementedError) as error:
            return error_message("bad_value", f"the stream refuses this switch: {error}")
        first = session.stream.session.index  # the next chunk made applies it (streams run without overlap here)
        session.prompts = [p for p in session.prompts if p[0] < first] + [(first, request.prompt)]
        return {"type": "switched", "prompt": request.prompt, "from_chunk": first}

    def _end_idle(self) -> None:
        for session in list(self._sessions.values()):
            if session.client.idle_seconds() > self.idle_timeout:
                self._end(session, error_message("idle", f"no frame was read for {self.idle_timeout:.0f} s; the "
                                                 "session ended and its cache was freed. Start again."))

    def _end(self, session: Session, message: dict | None) -> None:
        """Close the stream and drop every reference to it: its engines and kept latents are freed."""
        session.stream.close()
        with self._lock:
            del self._sessions[session.client]
        session.stream = None
        if message is not None:
            session.client.post(message)

    def _step(self) -> None:
        sessions = list(self._sessions.values())
        began = time.perf_counter()
        try:
            results = step_streams([s.stream for s in sessions], batched=self.batched)
        except Exception as error:  # a fault of the scheduler itself: no session can trust its state
            results = [error] * len(sessions)
        seconds = time.perf_counter() - began
        self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        for session, result in zip(sessions, results):
            if isinstance(result, BaseException):
                self._end(session, error_message("session_failed", f"making chunk {session.made} raised "
                                                 f"{type(result).__name__}: {result}; the session ended."))
            elif result is None:
                self._end(session, {"type": "done", "chunks": session.made})
            else:
                self._send(session, result)

    def _send(self, session: Session, chunk) -> None:
        frames = []
        for image in chunk.frames[0]:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG", compress_level=1)
            frames.append(buffer.getvalue())
        header = {"type": "chunk", "session": session.id, "chunk": chunk.index,
                  "video_frames": [chunk.video_frames.start, chunk.video_frames.stop], "frames": len(frames),
                  "prompt": session.prompt_of(chunk.index), "seconds": round(chunk.seconds, 4)}
        session.made += 1
        if session.chunks_left is not None:
            session.chunks_left -= 1
        session.client.post_chunk(header, frames)

    def _seconds_left(self, session: Session) -> float | None:
        if session.chunks_left is None:
            return None
        return session.chunks_left * (self._step_seconds or 1.0)
