"""A local Gradio page for ``CausalWanPipeline.stream()``: frames on screen chunk by chunk, a prompt switch while it
runs, and Stop.

    python examples/stream_app.py        # the tiny sprite model of models/tiny-sprites, at its 32x32
    python examples/stream_app.py --random   # tiny random components: the frames are coloured noise

then open http://127.0.0.1:7860, press Start, and try "Switch prompt" with "blue square moving down". Real
weights, as in ``examples/causal_rollout.py``:

    python examples/stream_app.py --checkpoint self_forcing_dmd.pt \\
        --model-id Wan-AI/Wan2.1-T2V-1.3B-Diffusers --height 480 --width 832

Start streams until Stop (or ``--max-chunks``): each chunk is decoded as soon as it is committed and its frames are
shown one by one at ``--fps``, with the chunk's latency, the time to first frame and the prompt the chunk was made
with. "Switch prompt" hands the new prompt to the running stream (``CausalWanStream.switch_prompt``): the next chunk
is made with it. Stop closes the stream: a chunk being made is finished (the cache holds whole chunks only), no frame
is shown after Stop, and a Start still waiting for its turn does not stream. An empty prompt (to Start or to Switch)
is refused on the page and changes nothing.

Nothing leaves the machine: the page is served on 127.0.0.1 only, without a share link, with Gradio's analytics
(and its version check) off and system fonts only.
"""

from __future__ import annotations

import os

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no telemetry, no version check

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from pathlib import Path  # noqa: E402

import gradio as gr  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HOST = "127.0.0.1"
SHOWN_CHUNKS = 10  # chunk lines kept in the status box
STOPPING = "stopping: the stream ends at its next frame"
WAITING_STOPPED = "stopped: the Start waiting for its turn will not stream"
CSS = "#frame img { width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated; }"  # scale frames up


def _causal_rollout():
    """``examples/causal_rollout.py`` (``tiny_pipeline``; ``load_pipeline`` for real weights), from beside this
    file."""
    path = Path(__file__).with_name("causal_rollout.py")
    spec = importlib.util.spec_from_file_location("causal_rollout_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None,
                        help="diffusers-format Wan pipeline (hub id or folder): the base components, or the whole "
                             "causal pipeline without --checkpoint; default: the tiny sprite model in "
                             "models/tiny-sprites")
    parser.add_argument("--checkpoint", default=None,
                        help="causal transformer (converted folder or a peer's checkpoint file); needs --model-id")
    parser.add_argument("--random", action="store_true",
                        help="tiny random components built in code instead of the sprite model (frames of noise)")
    parser.add_argument("--prompt", default=None,
                        help="the prompt the page starts with (default: 'red ball moving right' for the sprite "
                             "model, a fox in the snow otherwise)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--height", type=int, default=None, help="default: 32 for the sprite model, 64 otherwise")
    parser.add_argument("--width", type=int, default=None, help="default: 32 for the sprite model, 64 otherwise")
    parser.add_argument("--chunk-frames", type=int, default=None,
                        help="latent frames per chunk (default: the checkpoint's)")
    parser.add_argument("--max-chunks", type=int, default=None, help="end each stream after this many chunks")
    parser.add_argument("--fps", type=float, default=16.0,
                        help="frames per second at which a chunk's frames are shown (0: as fast as they come)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sprites = args.checkpoint is None and args.model_id is None and not args.random
    size = 32 if sprites else 64  # the sprite model's trained resolution
    args.height, args.width = args.height or size, args.width or size
    if args.prompt is None:
        args.prompt = "red ball moving right" if sprites else "a red fox running through fresh snow, cinematic"
    return args


class Session:
    """One browser session's running stream, the prompt its chunks are made with, and the status lines."""

    def __init__(self, stream, prompt: str) -> None:
        self.stream, self.prompt = stream, prompt
        self.requested: str | None = None
        self.lines: deque[str] = deque(maxlen=SHOWN_CHUNKS)
        self.lock = threading.Lock()
        self.chunks = 0
        self.first_frame_seconds: float | None = None

    def request_switch(self, prompt: str) -> None:
        with self.lock:
            self.requested = prompt

    def next_chunk(self):
        """The stream's next chunk (``None`` once it is closed), made with the latest requested prompt. The switch
        is handed to the stream here, on the thread that runs it, so the prompt recorded for a chunk is the one the
        stream used."""
        with self.lock:
            requested, self.requested = self.requested, None
        if requested is not None:
            self.stream.switch_prompt(requested)
            self.prompt = requested
        chunk = next(self.stream, None)
        if chunk is not None:
            self.chunks += 1
            if self.first_frame_seconds is None:
                self.first_frame_seconds = chunk.time_to_frames
            frames = chunk.video_frames
            self.lines.append(f"chunk {chunk.index} · video frames {frames.start}-{frames.stop - 1} · "
                              f"{chunk.seconds * 1000:.1f} ms · prompt: {self.prompt}")
        return chunk

    def status(self, headline: str) -> str:
        first = "" if self.first_frame_seconds is None else f" · time to first frame {self.first_frame_seconds:.3f} s"
        return "\n".join([headline + first, *self.lines])


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Frames in [0, 1] as uint8, rounded as diffusers rounds them."""
    return (frames * 255).round().clip(0, 255).astype(np.uint8)


def build_app(pipe, *, prompt: str = "a red fox running through fresh snow, cinematic", height: int = 64,
              width: int = 64, chunk_frames: int | None = None, max_chunks: int | None = None, fps: float = 16.0,
              seed: int = 0) -> gr.Blocks:
    """The page: Start streams ``pipe.stream(prompt, num_frames=None)`` (until Stop, or ``max_chunks`` chunks),
    "Switch prompt" applies a new prompt from the next chunk on, Stop closes the stream.

    One stream runs at a time (a second Start waits in Gradio's queue); each browser session has its own."""
    pipe.set_progress_bar_config(disable=True)
    sessions: dict[str, Session] = {}
    # Starts pressed but not yet streaming (waiting in the queue behind another session's stream, or opening their
    # own): "waiting", or "stopped" once Stop is pressed, so that a Start does not stream after its Stop.
    waiting: dict[str, str] = {}
    registry = threading.Lock()  # Stop and a Start's registration see each other whole

    def press_start(request: gr.Request) -> None:
        with registry:
            waiting[request.session_hash] = "waiting"

    def start(text: str, request: gr.Request):
        if not text.strip():
            with registry:
                waiting.pop(request.session_hash, None)
            yield gr.skip(), "a prompt is needed: type one, then press Start"
            return
        generator = torch.Generator(pipe.device).manual_seed(seed)
        stream = pipe.stream(prompt=text, height=height, width=width, num_frames=None, chunk_frames=chunk_frames,
                             generator=generator)
        session = Session(stream, text)
        with registry:
            sessions[request.session_hash] = session
            if waiting.pop(request.session_hash, None) == "stopped":
                stream.close()  # the loop below ends at once: "stopped after 0 chunks"
        try:
            while max_chunks is None or session.chunks < max_chunks:
                chunk = session.next_chunk()
                if chunk is None:
                    break
                shown = time.perf_counter()
                for number, frame in zip(chunk.video_frames, to_uint8(chunk.frames[0])):
                    if stream.closed:
                        break
                    if fps > 0:  # play the chunk: one frame every 1/fps seconds
                        time.sleep(max(0.0, shown - time.perf_counter()))
                        shown += 1 / fps
                    yield frame, session.status(f"streaming · video frame {number} · chunk {chunk.index}")
            ended = "stopped" if stream.closed else "done"
            yield gr.skip(), session.status(f"{ended} after {session.chunks} chunks")
        finally:
            stream.close()
            if sessions.get(request.session_hash) is session:
                del sessions[request.session_hash]

    def switch(text: str, request: gr.Request) -> str:
        if not text.strip():
            return "type the new prompt first: an empty prompt is not switched to"
        session = sessions.get(request.session_hash)
        if session is None:
            return "nothing is streaming: press Start"
        session.request_switch(text)
        return f"the next chunk is made with: {text}"

    def stop(request: gr.Request) -> str:
        with registry:
            session = sessions.get(request.session_hash)
            pressed = request.session_hash in waiting  # a Start pressed again, waiting behind this session's stream
            if pressed:
                waiting[request.session_hash] = "stopped"
        if session is None:
            return WAITING_STOPPED if pressed else "nothing is streaming"
        session.stream.close()  # Start's loop sees it at its next frame and writes the status's last line
        return STOPPING

    # analytics off here too; the frames shown are files in Gradio's cache: swept every minute
    with gr.Blocks(title="Causal Wan stream", analytics_enabled=False, delete_cache=(60, 60)) as app:
        gr.Markdown("## Causal Wan stream\nFrames appear chunk by chunk as the KV-cached rollout decodes them.")
        with gr.Row():
            with gr.Column():
                prompt_box = gr.Textbox(prompt, label="prompt", elem_id="prompt")
                with gr.Row():
                    start_button = gr.Button("Start", variant="primary")
                    stop_button = gr.Button("Stop", variant="stop")
                switch_box = gr.Textbox("", label="new prompt (from the next chunk on)", elem_id="switch")
                switch_button = gr.Button("Switch prompt")
                note = gr.Markdown("", elem_id="note")
            with gr.Column():
                frame = gr.Image(label="latest frame", type="numpy", format="png", interactive=False, height=360,
                                 buttons=["download", "fullscreen"], elem_id="frame")  # no share (upload) button
                status = gr.Textbox(label="status", lines=SHOWN_CHUNKS + 1, interactive=False, elem_id="status")
        # Pressing Start first marks the session as waiting (outside the queue, at once), so a Stop pressed while the
        # Start waits for its turn ends it; an API client calling /start directly skips that mark.
        start_button.click(press_start, None, None, queue=False, api_name="press_start").then(
            start, prompt_box, [frame, status], api_name="start", concurrency_limit=1)
        switch_button.click(switch, switch_box, note, api_name="switch")
        # Stop answers in the note, not the status: the status has one writer (Start's loop), so no update of the
        # stream can land after its "stopped after" line. No cancel either: the loop ends at its next frame.
        stop_button.click(stop, None, note, api_name="stop")
    return app


def launch(app: gr.Blocks, port: int, prevent_thread_lock: bool = False) -> gr.Blocks:
    """Serve ``app`` on 127.0.0.1 only: no share link, no server-side rendering (a Node server), system fonts."""
    theme = gr.themes.Base(font=["ui-sans-serif", "system-ui", "sans-serif"],
                           font_mono=["ui-monospace", "monospace"])
    app.queue().launch(server_name=HOST, server_port=port, share=False, ssr_mode=False, mcp_server=False,
                       theme=theme, css=CSS, prevent_thread_lock=prevent_thread_lock)
    return app


def main(argv=None, prevent_thread_lock: bool = False) -> gr.Blocks:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = _causal_rollout().load_pipeline(args, device).to(device)
    app = build_app(pipe, prompt=args.prompt, height=args.height, width=args.width, chunk_frames=args.chunk_frames,
                    max_chunks=args.max_chunks, fps=args.fps, seed=args.seed)
    print(f"serving on http://{HOST}:{args.port}/ (local only)")
    return launch(app, args.port, prevent_thread_lock=prevent_thread_lock)


if __name__ == "__main__":
    main()
