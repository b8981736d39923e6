"""Shared by the server tests: a tiny pipeline, a server on 127.0.0.1 in this process, a WebSocket client (and, from
``helpers``, the guard that refuses every connection or name lookup outside the loopback)."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time

import numpy as np
import PIL.Image
import torch
import uvicorn
from helpers import free_port, loopback_only  # noqa: F401 (re-exported: the server tests import them from here)
from websockets.sync.client import connect

from diffusers_causal_kv import CausalConfig, CausalWanPipeline
from diffusers_causal_kv.serve.protocol import Limits
from diffusers_causal_kv.serve.server import ServerOptions, create_server
from diffusers_causal_kv.testing import tiny_pipeline_components, tiny_wan

SIZE = 32
# Chunks of one latent frame in a window of 3 (it fills, then evicts, within a few chunks), two steps, guidance on
# (two cache tags per session).
CONFIG = CausalConfig(chunk_frames=1, timesteps=(1000, 500), shift=5.0, window_frames=3, guidance_scale=3.0)
LIMITS = Limits(max_height=64, max_width=64, max_frames=33, max_chunk_frames=2, max_prompt_chars=100)


def tiny_pipe(seed: int = 0) -> CausalWanPipeline:
    pipe = CausalWanPipeline(**tiny_pipeline_components(tiny_wan(seed=seed, ffn_dim=64, init=None), seed=seed),
                             causal_config=CONFIG)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def options(**changes) -> ServerOptions:
    return ServerOptions(**{"budget": 10**9, "height": SIZE, "width": SIZE, "limits": LIMITS, **changes})


@contextlib.contextmanager
def running_server(pipe, server_options: ServerOptions):
    """``(url, loop)`` of a server on 127.0.0.1 in a thread of this process."""
    app, loop = create_server(pipe, server_options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait(lambda: server.started, what="the server")
        yield f"127.0.0.1:{port}", loop
    finally:
        server.should_exit = True
        thread.join()
        loop.shutdown()


def wait(condition, seconds: float = 120.0, what: str = "the server"):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Viewer:
    """A WebSocket client of the protocol: ``messages`` (JSON) in order, ``frames[chunk]`` the decoded frames."""

    def __init__(self, address: str, token: str | None = None) -> None:
        query = "" if token is None else f"?token={token}"
        self.socket = connect(f"ws://{address}/ws{query}", open_timeout=30)
        self.messages: list[dict] = []
        self.frames: dict[int, list[np.ndarray]] = {}
        self._chunk = None

    def send(self, **message) -> None:
        self.socket.send(json.dumps(message))

    def receive(self) -> dict:
        """The next JSON message, after reading the frames of every chunk before it."""
        while True:
            data = self.socket.recv(timeout=120)
            if isinstance(data, bytes):
                self.frames[self._chunk].append(np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")))
                continue
            message = json.loads(data)
            self.messages.append(message)
            if message["type"] == "chunk":
                self._chunk = message["chunk"]
                self.frames[self._chunk] = []
            return message

    def until(self, *types: str) -> dict:
        while (message := self.receive())["type"] not in types:
            pass
        return message

    def video(self) -> np.ndarray:
        """Every frame received, in order (the last chunk's frames read in full)."""
        return np.stack([frame for index in sorted(self.frames) for frame in self.frames[index]])

    def close(self) -> None:
        self.socket.close()


def direct_video(pipe, prompt: str, seed: int, chunks: int, **kwargs) -> tuple[np.ndarray, list]:
    """The frames of the first ``chunks`` chunks of ``pipe.stream`` alone, as the server sends them (PNG is
    lossless), and those chunks."""
    stream = pipe.stream(prompt=prompt, height=SIZE, width=SIZE, num_frames=None,
                         generator=torch.Generator().manual_seed(seed), output_type="pil", overlap=False, **kwargs)
    with stream:
        made = [next(stream) for _ in range(chunks)]
    return np.stack([np.asarray(image.convert("RGB")) for chunk in made for image in chunk.frames[0]]), made


def assert_same_video(got: np.ndarray, expected: np.ndarray) -> None:
    """Frames of sessions made in one batch equal those of separate streams to fp32 rounding (the batching's bound,
    1e-5), which may move a value across a rounding step of the 8-bit PNG: by one level at most, and rarely."""
    assert got.shape == expected.shape
    difference = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3, (difference.max(), (difference > 0).mean())
