"""The stream server (diffusers_causal_kv.serve) through real WebSocket clients on 127.0.0.1: several sessions give
the frames of separate ``pipe.stream`` runs, prompt switches land on the chunk the server names, sessions that end
free their cache, admission by memory, a stalled client costs the others nothing, and bad requests change nothing.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from serve_helpers import (
    SIZE,
    Viewer,
    assert_same_video,
    direct_video,
    loopback_only,
    options,
    running_server,
    tiny_pipe,
    wait,
)

from diffusers_causal_kv.serve import app as app_module
from diffusers_causal_kv.serve import sessions as sessions_module
from diffusers_causal_kv.serve.admission import session_cache_bytes
from diffusers_causal_kv.serve.app import Mailbox

PROMPTS = [("a red ball", 1), ("a blue cube on a table", 2), ("a green hill", 3)]


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipe()


@pytest.fixture(autouse=True)
def _loopback():
    with loopback_only():
        yield


@pytest.fixture
def recorded(pipe, monkeypatch):
    """Every stream the server opens, in order (their sessions' engines are checked freed)."""
    streams, stream = [], pipe.stream
    monkeypatch.setattr(pipe, "stream", lambda *a, **k: streams.append(stream(*a, **k)) or streams[-1])
    return streams


def _engines(stream) -> list[weakref.ref]:
    return [weakref.ref(engine) for engines in stream.session.engine_maps() for engine in engines.values()]


def test_sessions_through_the_server_equal_separate_streams(pipe):
    chunks = 4  # 13 video frames: 1 + 4 x 3
    with running_server(pipe, options()) as (address, loop):
        viewers = [Viewer(address) for _ in PROMPTS]
        for viewer, (prompt, seed) in zip(viewers, PROMPTS):
            viewer.send(type="start", prompt=prompt, seed=seed, num_frames=13)
        started = [viewer.until("started") for viewer in viewers]
        assert len({s["session"] for s in started}) == len(PROMPTS)
        assert len(loop.snapshot()) == len(PROMPTS)
        done = [viewer.until("done") for viewer in viewers]
        assert [d["chunks"] for d in done] == [chunks] * len(PROMPTS)
        wait(lambda: loop.snapshot() == {}, what="the finished sessions to leave the table")
        assert loop.held_bytes() == 0
    for viewer, (prompt, seed) in zip(viewers, PROMPTS):
        expected, _ = direct_video(pipe, prompt, seed, chunks)
        assert expected.shape == (13, SIZE, SIZE, 3) and expected.std() > 1
        assert_same_video(viewer.video(), expected)
        headers = [m for m in viewer.messages if m["type"] == "chunk"]
        assert [h["chunk"] for h in headers] == list(range(chunks))
        assert [h["video_frames"] for h in headers] == [[0, 1], [1, 5], [5, 9], [9, 13]]
        assert {h["prompt"] for h in headers} == {prompt} and sum(h["dropped"] for h in headers) == 0
        viewer.close()


def test_a_prompt_switch_lands_on_the_chunk_the_server_names_and_stop_frees_the_cache(pipe, recorded):
    new = "a snowy street at night"
    with running_server(pipe, options()) as (address, loop):
        viewer = Viewer(address)
        viewer.send(type="start", prompt=PROMPTS[0][0], seed=PROMPTS[0][1])
        viewer.until("chunk")
        viewer.send(type="switch", prompt=new)
        switched = viewer.until("switched")
        at = switched["from_chunk"]
        assert at >= 1 and switched["prompt"] == new
        while viewer.until("chunk")["chunk"] < at + 1:
            pass
        engines = _engines(recorded[0])
        viewer.send(type="stop")
        stopped = viewer.until("stopped")
        assert loop.snapshot() == {}
        made = stopped["chunks"]
        recorded.clear()
        gc.collect()
        assert [ref() for ref in engines] == [None] * len(engines)  # the stream's cache is gone
        viewer.close()
    headers = [m for m in viewer.messages if m["type"] == "chunk"]
    assert [h["prompt"] for h in headers] == [PROMPTS[0][0]] * at + [new] * (made - at)
    expected, _ = direct_video(pipe, PROMPTS[0][0], PROMPTS[0][1], made, prompt_schedule={at: new})
    np.testing.assert_array_equal(viewer.video(), expected)
    unswitched, _ = direct_video(pipe, PROMPTS[0][0], PROMPTS[0][1], made)
    first = headers[at]["video_frames"][0]
    np.testing.assert_array_equal(viewer.video()[:first], unswitched[:first])
    assert not np.array_equal(viewer.video()[first:], unswitched[first:])


def test_a_client_gone_mid_chunk_frees_its_cache_and_the_others_frames_are_unchanged(pipe, recorded, monkeypatch):
    in_chunk, release = threading.Event(), threading.Event()
    step = sessions_module.step_streams

    def held_step(streams, **kwargs):  # the third batch waits inside its chunk until the test lets it go
        held_step.calls += 1
        if held_step.calls == 3:
            in_chunk.set()
            release.wait(60)
        return step(streams, **kwargs)

    held_step.calls = 0
    monkeypatch.setattr(sessions_module, "step_streams", held_step)
    with running_server(pipe, options()) as (address, loop):
        leaving, staying = Viewer(address), Viewer(address)
        leaving.send(type="start", prompt=PROMPTS[0][0], seed=PROMPTS[0][1])
        leaving.until("started")
        staying.send(type="start", prompt=PROMPTS[1][0], seed=PROMPTS[1][1], num_frames=17)
        staying.until("started")
        assert in_chunk.wait(60)
        engines = _engines(recorded[0])
        leaving.close()  # while both sessions' chunk is in flight
        release.set()
        wait(lambda: len(loop.snapshot()) == 1, what="the gone client's session to end")
        (left,) = loop.snapshot().values()
        assert left["prompt"] == PROMPTS[1][0] and loop.held_bytes() == left["cache_bytes"]
        recorded.pop(0)
        gc.collect()
        assert [ref() for ref in engines] == [None] * len(engines)
        staying.until("done")
        staying.close()
    expected, _ = direct_video(pipe, *PROMPTS[1], 5)
    assert_same_video(staying.video(), expected)


def test_sessions_past_the_memory_budget_are_refused_with_when_to_retry_and_admitted_later(pipe):
    probe = pipe.stream(prompt="x", height=SIZE, width=SIZE, num_frames=None, output_type="pil", overlap=False)
    need = session_cache_bytes(probe)
    probe.close()
    with running_server(pipe, options(budget=need + need // 2)) as (address, loop):
        first, second = Viewer(address), Viewer(address)
        first.send(type="start", prompt=PROMPTS[0][0], seed=PROMPTS[0][1], num_frames=9)
        assert first.until("started")["cache_bytes"] == need
        before = loop.snapshot()
        second.send(type="start", prompt=PROMPTS[1][0], seed=PROMPTS[1][1], num_frames=5)
        refused = second.until("error")
        assert refused["code"] == "over_budget" and "retry in about" in refused["message"]
        assert refused["retry_after"] >= 0
        assert loop.snapshot().keys() == before.keys()
        first.until("done")
        wait(lambda: loop.snapshot() == {}, what="the first session to end")
        second.send(type="start", prompt=PROMPTS[1][0], seed=PROMPTS[1][1], num_frames=5)
        assert second.until("started")["cache_bytes"] == need
        second.until("done")
        for viewer in (first, second):
            viewer.close()
    for viewer, (prompt, seed), chunks in ((first, PROMPTS[0], 3), (second, PROMPTS[1], 2)):
        np.testing.assert_array_equal(viewer.video(), direct_video(pipe, prompt, seed, chunks)[0])


def test_a_session_that_needs_more_than_the_whole_budget_is_told_so(pipe):
    with running_server(pipe, options(budget=1000)) as (address, loop):
        viewer = Viewer(address)
        viewer.send(type="start", prompt="x")
        refused = viewer.until("error")
        viewer.close()
    assert refused["code"] == "over_budget" and "more than the server's whole budget" in refused["message"]
    assert "retry_after" not in refused


BAD = [
    ("not json", "bad_json"),
    ("[1, 2]", "bad_json"),
    ('{"type": "play"}', "unknown_type"),
    ('{"type": "start", "prompt": "x", "fps": 30}', "unknown_field"),
    ('{"type": "start"}', "bad_value"),
    ('{"type": "start", "prompt": "   "}', "bad_value"),
    ('{"type": "start", "prompt": 5}', "bad_value"),
    ('{"type": "start", "prompt": "' + "x" * 101 + '"}', "too_large"),
    ('{"type": "start", "prompt": "x", "height": 4096}', "too_large"),
    ('{"type": "start", "prompt": "x", "width": 40}', "bad_value"),
    ('{"type": "start", "prompt": "x", "height": 0}', "bad_value"),
    ('{"type": "start", "prompt": "x", "num_frames": 37}', "too_large"),
    ('{"type": "start", "prompt": "x", "num_frames": 6}', "bad_value"),
    ('{"type": "start", "prompt": "x", "num_frames": null}', "bad_value"),
    ('{"type": "start", "prompt": "x", "chunk_frames": 3}', "too_large"),
    ('{"type": "start", "prompt": "x", "seed": -1}', "bad_value"),
    ('{"type": "start", "prompt": "x", "seed": true}', "bad_value"),
    ('{"type": "start", "prompt": "x", "guidance_scale": NaN}', "bad_value"),
    ('{"type": "start", "prompt": "x", "guidance_scale": 0.5}', "bad_value"),
    ('{"type": "start", "prompt": "x", "prompt_switch": "fade"}', "bad_value"),
    ('{"type": "switch", "prompt": "x", "mode": "fade"}', "bad_value"),
    ('{"type": "stop", "now": true}', "unknown_field"),
    ('{"type": "start", "prompt": "' + "x" * 5000 + '"}', "too_large"),
]


def test_malformed_and_oversized_requests_are_refused_and_change_nothing(pipe):
    with running_server(pipe, options()) as (address, loop):
        idle, streaming = Viewer(address), Viewer(address)
        idle.send(type="switch", prompt="y")  # well formed, but nothing streams here
        assert idle.until("error")["code"] == "not_streaming"
        idle.send(type="stop")
        assert idle.until("error")["code"] == "not_streaming"
        streaming.send(type="start", prompt=PROMPTS[0][0], seed=PROMPTS[0][1], num_frames=17)
        streaming.until("started")
        streaming.send(type="start", prompt="another")
        assert streaming.until("error")["code"] == "already_streaming"
        for sender, refused_texts in ((idle, BAD), (streaming, BAD[::6])):
            for text, code in refused_texts:
                table = loop.snapshot()
                sender.socket.send(text)
                refused = sender.until("error")
                assert refused["code"] == code, (text, refused)
                assert refused["message"]
                assert loop.snapshot().keys() == table.keys()
            sender.socket.send(b"\x00binary")
            assert sender.until("error")["code"] == "bad_json"
        assert len(loop.snapshot()) == 1
        streaming.until("done")  # the session ran on, undisturbed
        for viewer in (idle, streaming):
            viewer.close()
    np.testing.assert_array_equal(streaming.video(), direct_video(pipe, *PROMPTS[0], 5)[0])


def test_settings_the_model_refuses_or_a_failing_start_change_nothing_and_the_loop_goes_on(pipe, monkeypatch):
    errors = [ValueError("chunk_frames=2 does not fit this window; pass chunk_frames=1."),
              RuntimeError("out of memory encoding the prompt")]

    def failing_stream(**kwargs):
        raise errors.pop(0)

    monkeypatch.setattr(pipe, "stream", failing_stream)
    with running_server(pipe, options()) as (address, loop):
        viewer = Viewer(address)
        viewer.send(type="start", prompt="x", chunk_frames=2)
        refused = viewer.until("error")
        viewer.send(type="start", prompt="x")
        failed = viewer.until("error")
        assert loop.snapshot() == {}
        monkeypatch.undo()
        viewer.send(type="start", prompt="x", num_frames=1)
        assert viewer.until("started")
        viewer.until("done")
        viewer.close()
    assert refused["code"] == "bad_value"
    assert refused["message"] == "the model refuses these settings: chunk_frames=2 does not fit this window; pass " \
        "chunk_frames=1."
    assert failed == {"type": "error", "code": "session_failed", "message": "the server could not take this request: "
                      "RuntimeError: out of memory encoding the prompt"}


def test_the_token_is_required_when_set(pipe):
    with running_server(pipe, options(token="s3cret")) as (address, loop):
        for token in (None, "wrong"):
            viewer = Viewer(address, token)
            assert viewer.receive()["code"] == "unauthorized"
            viewer.close()
        viewer = Viewer(address, "s3cret")
        viewer.send(type="start", prompt="x", num_frames=1)
        assert viewer.until("started")
        viewer.until("done")
        viewer.close()


def test_a_stalled_client_loses_its_oldest_chunks_and_then_its_session_never_the_others_frames(pipe, monkeypatch):
    """One client's connection stops taking messages after ``started``; the other's frames all arrive and equal a
    separate stream; the stalled one's mailbox drops chunks, and after the idle timeout its session ends."""
    send, boxes = app_module._send, []

    async def stalling_send(websocket, mailbox):
        boxes.append(mailbox)
        if len(boxes) > 1:
            return await send(websocket, mailbox)
        await websocket.send_text('{"type": "stalled"}')
        await asyncio.Event().wait()  # never reads its mailbox again

    monkeypatch.setattr(app_module, "_send", stalling_send)
    with running_server(pipe, options(idle_timeout=2.0)) as (address, loop):
        stalled, reading = Viewer(address), Viewer(address)
        assert stalled.receive()["type"] == "stalled"
        stalled.send(type="start", prompt=PROMPTS[0][0], seed=PROMPTS[0][1])
        wait(lambda: len(loop.snapshot()) == 1, what="the stalled client's session")
        reading.send(type="start", prompt=PROMPTS[1][0], seed=PROMPTS[1][1], num_frames=21)
        reading.until("done")
        wait(lambda: loop.snapshot() == {}, what="the idle timeout")
        assert boxes[0].dropped > 0
        for viewer in (stalled, reading):
            viewer.close()
    assert_same_video(reading.video(), direct_video(pipe, *PROMPTS[1], 6)[0])


def test_the_mailbox_drops_the_oldest_waiting_chunk_never_a_reply():
    async def scenario():
        box = Mailbox(asyncio.get_running_loop(), max_queued_chunks=2)
        box.post({"type": "started"})
        for index in range(5):
            box.post_chunk({"chunk": index}, [b"png"])
        box.post({"type": "stopped"})
        await asyncio.sleep(0)
        return [await box.get() for _ in range(4)], box.dropped

    taken, dropped = asyncio.run(scenario())
    assert dropped == 3
    assert taken == [("message", {"type": "started"}), ("chunk", ({"chunk": 3}, [b"png"])),
                     ("chunk", ({"chunk": 4}, [b"png"])), ("message", {"type": "stopped"})]


@pytest.mark.parametrize("guidance, window, sink, chunk", [(3.0, 3, 0, 1), (1.0, 5, 1, 2), (3.0, 4, 0, 3)])
def test_the_admitted_size_is_what_the_session_holds_once_its_window_is_full(guidance, window, sink, chunk):
    pipe = tiny_pipe()
    pipe.causal_config = pipe.causal_config.replace(window_frames=window, sink_frames=sink, guidance_scale=guidance,
                                                    chunk_frames=chunk)
    stream = pipe.stream(prompt="x", height=SIZE, width=48, num_frames=None, output_type="latent", overlap=False,
                         generator=torch.Generator().manual_seed(0))
    need = session_cache_bytes(stream)
    held = []
    with stream:
        for _ in range(5):
            next(stream)
            engines = pipe.cache_memory_bytes(stream.session.planner.cache_engines)["transformer"]
            kept = sum(latents.nbytes for _, latents in stream.session.window())
            assert stream.session.memory_bytes() == engines + kept
            held.append(stream.session.memory_bytes())
    assert max(held) == held[-1] == need  # reached once the window is full, never passed


def test_the_command_line_ends_with_one_line_when_it_cannot_load_the_model(tmp_path, capsys):
    from diffusers_causal_kv.serve.__main__ import main

    assert main([str(tmp_path / "missing"), "--device", "cpu"]) == 1
    printed = capsys.readouterr().err
    assert printed.startswith("error: ") and printed.count("\n") == 1
