"""The web app in front of a :class:`~.sessions.SessionLoop`: the client page, ``/health`` and the ``/ws`` protocol.

Each WebSocket connection gets a :class:`Mailbox`. The loop's thread posts into it without waiting; a task of the
connection sends what it holds. A client that reads slower than chunks are made gets fewer chunks, never the others:
when ``max_queued_chunks`` chunks already wait for it, the oldest waiting chunk is dropped (the next chunk sent says
how many were dropped), so it sees the newest frames. Replies and errors are never dropped.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import time
from importlib import resources

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .protocol import RequestError, RequestParser, error_message
from .sessions import SessionLoop

STATIC = resources.files(__package__) / "static"
PAGE_TYPES = {"index.html": "text/html; charset=utf-8", "client.js": "text/javascript; charset=utf-8",
              "style.css": "text/css; charset=utf-8"}


class Mailbox:
    """A connection's outgoing messages: posted from any thread, sent by the connection's task, in order. Chunks
    beyond ``max_queued_chunks`` push out the oldest waiting chunk."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_queued_chunks: int = 2) -> None:
        self._loop, self._max = loop, max_queued_chunks
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._dropped = 0
        self._waiting_since: float | None = None
        self.closed = False

    def post(self, message: dict) -> None:
        self._loop.call_soon_threadsafe(self._put, ("message", message))

    def post_chunk(self, header: dict, frames: list[bytes]) -> None:
        self._loop.call_soon_threadsafe(self._put, ("chunk", (header, frames)))

    def idle_seconds(self) -> float:
        since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def dropped(self) -> int:
        """Chunks dropped for this client so far."""
        return self._dropped

    def _put(self, item: tuple) -> None:
        if self.closed:
            return
        if item[0] == "chunk":
            queued = [i for i in self._items if i[0] == "chunk"]
            if len(queued) >= self._max:
                self._items.remove(queued[0])
                self._dropped += 1
        self._items.append(item)
        self._waiting_since = self._waiting_since or time.monotonic()
        self._ready.set()

    async def get(self) -> tuple:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        self._waiting_since = time.monotonic() if self._items else None
        return item


def build_app(loop: SessionLoop, parser: RequestParser, *, token: str | None = None,
              max_queued_chunks: int = 2) -> FastAPI:
    """The FastAPI app serving ``loop``'s sessions (also the ASGI app of each Ray Serve replica).

    Args:
        loop: the session loop (started by the caller).
        parser: checks the requests against the server's limits.
        token: when set, ``/ws`` takes only connections whose ``token`` query parameter equals it.
        max_queued_chunks: chunks that may wait for a client before its oldest is dropped.
    """
    app = FastAPI(title="diffusers-causal-kv stream server", docs_url=None, redoc_url=None, openapi_url=None)
    limits = parser.limits

    @app.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in PAGE_TYPES:
            return Response(status_code=404)
        return Response((STATIC / name).read_bytes(), media_type=PAGE_TYPES[name])

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"server": loop.name, "sessions": len(loop.snapshot()), "held_bytes": loop.held_bytes(),
                             "budget": loop.budget, "max_sessions": loop.max_sessions,
                             "limits": {name: getattr(limits, name) for name in limits.__dataclass_fields__},
                             "default_size": list(parser.default_size), "token": token is not None})

    @app.websocket("/ws")
    async def session(websocket: WebSocket) -> None:
        await websocket.accept()
        if token is not None and not hmac.compare_digest(websocket.query_params.get("token", ""), token):
            await websocket.send_text(json.dumps({"type": "error", "code": "unauthorized", "message":
                                                  "this server takes a token: connect to /ws?token=..."}))
            await websocket.close(code=1008)
            return
        mailbox = Mailbox(asyncio.get_running_loop(), max_queued_chunks)
        sender = asyncio.create_task(_send(websocket, mailbox))
        try:
            while True:
                incoming = await websocket.receive()
                if incoming["type"] == "websocket.disconnect":
                    break
                text = incoming.get("text")
                if text is None:
                    mailbox.post(error_message("bad_json", "requests are JSON text messages, not binary ones."))
                    continue
                try:
                    loop.submit(mailbox, parser.parse(text))
                except RequestError as refused:
                    mailbox.post(refused.to_message())
        except WebSocketDisconnect:
            pass
        finally:
            mailbox.closed = True
            loop.disconnect(mailbox)
            sender.cancel()

    return app


async def _send(websocket: WebSocket, mailbox: Mailbox) -> None:
    reported = 0
    try:
        while True:
            kind, payload = await mailbox.get()
            if kind == "message":
                await websocket.send_text(json.dumps(payload))
                continue
            header, frames = payload
            header = {**header, "dropped": mailbox.dropped - reported}
            reported = mailbox.dropped
            await websocket.send_text(json.dumps(header))
            for frame in frames:
                await websocket.send_bytes(frame)
    except (WebSocketDisconnect, RuntimeError):
        pass  # the connection closed; the receiving side ends the session
