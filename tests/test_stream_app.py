"""examples/stream_app.py, driven end to end: through its API with gradio_client (frames arrive and equal a direct
``pipe.stream``, a prompt switch applies from the next chunk, Stop ends the stream) and in headless Chromium (a
frame is displayed and the page makes no request outside 127.0.0.1)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import PIL.Image
import pytest
import torch
from helpers import free_port, loopback_only

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))  # sprites: the sprite model's judge
SIZE = ["--height", "32", "--width", "32", "--chunk-frames", "1", "--fps", "0"]
SEED = 0
OLD, NEW = "a red ball", "a blue cube on a table"
CHUNK_LINE = re.compile(r"^chunk (\d+) · video frames (\d+)-(\d+) · [\d.]+ ms · prompt: (.*)$", re.MULTILINE)
FRAME_HEADLINE = re.compile(r"^streaming · video frame (\d+) · chunk (\d+)")
CHROMEDRIVER = "/usr/bin/chromedriver"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stream_app(tmp_path_factory):
    """The example module; while its tests run, every connection or name lookup of this process (the servers, the
    clients) to anything but the loopback is refused and recorded, and none may have happened."""
    with pytest.MonkeyPatch.context() as patch, loopback_only():
        patch.setenv("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))  # the frames the server writes
        # gradio_client's Client builds huggingface_hub headers, which fetch a registry from the Hub unless offline
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield _load("stream_app")


def test_a_checkpoint_without_model_id_ends_with_one_line(stream_app):
    with pytest.raises(SystemExit, match="--checkpoint holds the causal transformer only; pass --model-id"):
        stream_app.main(["--checkpoint", "self_forcing_dmd.pt"])


def test_the_page_loads_the_shipped_sprite_model_at_its_trained_resolution_by_default(stream_app):
    args = stream_app.parse_args([])
    assert (args.random, args.height, args.width, args.prompt) == (False, 32, 32, "red ball moving right")
    pipe = _load("causal_rollout").load_pipeline(args, torch.device("cpu"))
    assert pipe.transformer.config.num_layers > 0 and pipe.tokenizer("red").input_ids[0] != pipe.tokenizer.unk_token_id
    random = stream_app.parse_args(["--random"])
    assert (random.height, random.width) == (64, 64) and random.prompt != args.prompt


@pytest.fixture(scope="module")
def bounded(stream_app):
    """The app as ``main`` starts it with ``--random`` (tiny pipeline), each stream ending after 3 chunks."""
    port = free_port()
    app = stream_app.main(["--random", *SIZE, "--port", str(port), "--max-chunks", "3", "--prompt", OLD],
                          prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}/"
    app.close()


@pytest.fixture(scope="module")
def unbounded(stream_app):
    """(url, pipe): ``build_app`` on a tiny pipeline, streaming until Stop."""
    pipe = _load("causal_rollout").tiny_pipeline(SEED)
    port = free_port()
    app = stream_app.launch(stream_app.build_app(pipe, height=32, width=32, chunk_frames=1, fps=0, seed=SEED), port,
                            prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}/", pipe
    app.close()


def _client(url: str, tmp_path):
    from gradio_client import Client

    return Client(url, analytics_enabled=False, verbose=False, download_files=str(tmp_path))


def _wait(condition, seconds: float = 60.0, what: str = "the app"):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _shown_frames(outputs) -> dict[int, np.ndarray]:
    """Video frame number -> the frame the app showed, from its (image, status) updates."""
    shown = {}
    for image, status in outputs:
        headline = FRAME_HEADLINE.match(status)
        if headline:
            shown[int(headline.group(1))] = np.asarray(PIL.Image.open(image).convert("RGB"))
    return shown


def _chunk_prompts(outputs) -> list[str]:
    """The prompt of each chunk, from the chunk lines of the status updates (each keeps the latest few)."""
    prompts = {}
    for _, status in outputs:
        prompts.update({int(index): prompt for index, _, _, prompt in CHUNK_LINE.findall(status)})
    assert sorted(prompts) == list(range(len(prompts)))
    return [prompts[index] for index in range(len(prompts))]


def _direct_stream(pipe, chunks: int, **kwargs) -> list:
    """The first ``chunks`` chunks of ``pipe.stream`` with the app's settings."""
    stream = pipe.stream(height=32, width=32, num_frames=None, chunk_frames=1,
                         generator=torch.Generator().manual_seed(SEED), **kwargs)
    with stream:
        return [next(stream) for _ in range(chunks)]


def _frames(stream_app, chunks) -> np.ndarray:
    """Video frames of ``chunks`` as the app shows them (uint8)."""
    return np.concatenate([stream_app.to_uint8(chunk.frames[0]) for chunk in chunks])


class RecordingStream:
    """A ``CausalWanStream`` that keeps the chunks it hands out (what the app's stream really made)."""

    def __init__(self, stream) -> None:
        self.stream, self.chunks = stream, []

    def __iter__(self):
        return self

    def __next__(self):
        chunk = next(self.stream)
        self.chunks.append(chunk)
        return chunk

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_frames_arrive_chunk_by_chunk_and_equal_a_direct_stream(stream_app, bounded, tmp_path):
    job = _client(bounded, tmp_path).submit(OLD, api_name="/start")
    _wait(job.done, what="the stream to end after --max-chunks 3")
    outputs = job.outputs()
    assert outputs[-1][1].startswith("done after 3 chunks · time to first frame ")
    assert _chunk_prompts(outputs) == [OLD] * 3
    shown = _shown_frames(outputs)
    assert sorted(shown) == list(range(9))  # chunks of 1 latent frame: 1 + 4 + 4 video frames, each shown
    expected = _frames(stream_app, _direct_stream(_load("causal_rollout").tiny_pipeline(SEED), 3, prompt=OLD))
    np.testing.assert_array_equal(np.stack([shown[i] for i in range(9)]), expected)
    assert expected.std() > 1  # decoded content, not a blank frame


def test_a_prompt_switch_applies_from_the_next_chunk_and_stop_ends_the_stream(stream_app, unbounded, tmp_path,
                                                                             monkeypatch):
    url, pipe = unbounded
    recordings, stream = [], pipe.stream
    monkeypatch.setattr(pipe, "stream", lambda *args, **kwargs: recordings.append(
        RecordingStream(stream(*args, **kwargs))) or recordings[-1])
    client = _client(url, tmp_path)
    assert client.predict(NEW, api_name="/switch") == "nothing is streaming: press Start"
    job = client.submit(OLD, api_name="/start")
    _wait(lambda: len(job.outputs()) >= 1, what="the first frame")
    assert client.predict(NEW, api_name="/switch") == f"the next chunk is made with: {NEW}"

    def switched_and_one_more():
        prompts = _chunk_prompts(job.outputs())
        return NEW in prompts and prompts.index(NEW) + 1 < len(prompts)

    _wait(switched_and_one_more, what="two chunks under the new prompt")
    assert client.predict(api_name="/stop") == stream_app.STOPPING
    _wait(job.done, seconds=30, what="the stream to end after Stop")
    assert job.outputs()[-1][1].startswith("stopped after ")
    assert client.predict(NEW, api_name="/switch") == "nothing is streaming: press Start"
    (recording,) = recordings
    assert recording.closed
    monkeypatch.undo()

    # The status names the prompt of each chunk: the old one, then the new one from the chunk after the switch on.
    prompts = _chunk_prompts(job.outputs())
    switch_at = prompts.index(NEW)
    assert switch_at >= 1 and prompts == [OLD] * switch_at + [NEW] * (len(prompts) - switch_at)
    assert len(recording.chunks) == len(prompts)
    # The app's stream made exactly the chunks of a stream whose prompt changes at that chunk (prompt_schedule), and
    # its chunk there differs from an unswitched stream's: the switch took effect at that chunk, not earlier or later.
    made = recording.chunks[:switch_at + 1]
    switched = _direct_stream(pipe, switch_at + 1, prompt=OLD, prompt_schedule={switch_at: NEW})
    unswitched = _direct_stream(pipe, switch_at + 1, prompt=OLD)
    for ours, theirs in zip(made, switched):
        assert torch.equal(ours.latents, theirs.latents)
    for ours, theirs in zip(made[:-1], unswitched[:-1]):
        assert torch.equal(ours.latents, theirs.latents)
    assert not torch.allclose(made[-1].latents, unswitched[-1].latents, atol=1e-4)
    # and it showed their frames
    shown, expected = _shown_frames(job.outputs()), _frames(stream_app, switched)
    np.testing.assert_array_equal(np.stack([shown[i] for i in range(len(expected))]), expected)


def test_an_empty_prompt_is_refused_on_the_page_and_changes_nothing(stream_app, unbounded, tmp_path):
    url, pipe = unbounded
    client = _client(url, tmp_path)
    job = client.submit("  ", api_name="/start")
    _wait(job.done, what="the refused start")
    assert [status for _, status in job.outputs()] == ["a prompt is needed: type one, then press Start"]
    assert client.predict(api_name="/stop") == "nothing is streaming"  # no stream was opened
    job = client.submit(OLD, api_name="/start")
    _wait(lambda: len(job.outputs()) >= 1, what="the first frame")
    assert client.predict("", api_name="/switch") == "type the new prompt first: an empty prompt is not switched to"
    _wait(lambda: len(_chunk_prompts(job.outputs())) >= 3, what="three chunks")
    assert set(_chunk_prompts(job.outputs())) == {OLD}  # the empty switch was not applied
    assert client.predict(api_name="/stop") == stream_app.STOPPING
    _wait(job.done, seconds=30, what="the stream to end after Stop")


def test_a_stop_while_the_start_waits_for_its_turn_ends_that_start(stream_app, unbounded, tmp_path):
    """One stream runs at a time: B's Start waits in the queue behind A's stream. B's Stop then ends B's Start: once
    A stops, B's Start shows no frame and ends at once (it used to stream, with no end, after its Stop)."""
    url, _ = unbounded
    a, b = _client(url, tmp_path), _client(url, tmp_path)
    streaming = a.submit(OLD, api_name="/start")
    _wait(lambda: len(streaming.outputs()) >= 1, what="A's first frame")
    b.predict(api_name="/press_start")  # what the page's Start button does before its queued /start
    waiting = b.submit(NEW, api_name="/start")
    assert b.predict(api_name="/stop") == stream_app.WAITING_STOPPED
    assert a.predict(api_name="/stop") == stream_app.STOPPING
    _wait(waiting.done, seconds=30, what="B's Start to end")
    outputs = waiting.outputs()
    assert not _shown_frames(outputs) and outputs[-1][1].startswith("stopped after 0 chunks"), outputs


def test_stop_without_a_stream_says_so(unbounded, tmp_path):
    assert _client(unbounded[0], tmp_path).predict(api_name="/stop") == "nothing is streaming"


def _browser_or_skip():
    chromium = shutil.which("chromium")
    if chromium is None or not os.path.exists(CHROMEDRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900",
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",  # no name resolves but 127.0.0.1
                 "--disable-component-update", "--disable-background-networking", "--disable-sync",
                 "--disable-default-apps", "--no-first-run", "--no-default-browser-check"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.mark.slow
def test_the_page_streams_frames_until_stop_in_chromium_and_requests_nothing_outside_the_machine(stream_app,
                                                                                                 unbounded):
    from selenium.webdriver.common.by import By

    browser = _browser_or_skip()
    try:
        browser.get(unbounded[0])
        button = lambda name: browser.find_element(By.XPATH, f"//button[normalize-space()='{name}']")  # noqa: E731
        _wait(lambda: browser.find_elements(By.XPATH, "//button[normalize-space()='Start']"), what="the page")
        button("Start").click()

        def frame_shown():  # a decoded 32x32 frame, loaded and displayed
            return any(img.is_displayed() and browser.execute_script(
                "return arguments[0].complete && arguments[0].naturalWidth === 32 "
                "&& arguments[0].src.includes('/gradio_api/file=')", img)
                for img in browser.find_elements(By.CSS_SELECTOR, "#frame img"))

        status = lambda: browser.find_element(By.CSS_SELECTOR, "#status textarea").get_attribute("value")  # noqa: E731
        _wait(frame_shown, what="a frame on the page")
        _wait(lambda: "chunk 2 · " in status(), what="three chunks on the page")
        # Stop closes the stream; Start's loop then ends with the status's last line, and Stop's answer is a note
        button("Stop").click()
        _wait(lambda: status().startswith("stopped after "), seconds=30, what="the page to show the stream stopped")
        time.sleep(1)
        assert status().startswith("stopped after ")  # nothing from the stream came after
        assert browser.find_element(By.ID, "note").text == stream_app.STOPPING
        urls = [event["params"]["request"]["url"] for event in
                (json.loads(entry["message"])["message"] for entry in browser.get_log("performance"))
                if event["method"] == "Network.requestWillBeSent"]
    finally:
        browser.quit()
    assert any("/gradio_api/file=" in url for url in urls)
    outside = [url for url in urls
               if not re.match(r"(https?://(127\.0\.0\.1|localhost)(:\d+)?/|data:|blob:)", url)]
    assert outside == []



@pytest.fixture(scope="module")
def sprite_page(stream_app):
    """The app as ``python examples/stream_app.py --fps 4`` starts it: the shipped sprite model at its 32x32, each
    frame on screen for a quarter of a second (long enough for the test to see every one)."""
    port = free_port()
    app = stream_app.main(["--fps", "4", "--port", str(port)], prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}/"
    app.close()


def _png(url: str) -> np.ndarray:
    """A frame the page shows, fetched from its server (on 127.0.0.1) as the browser did."""
    import io
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return np.asarray(PIL.Image.open(io.BytesIO(response.read())).convert("RGB"), dtype=np.float32) / 255


@pytest.mark.slow
def test_a_switch_on_the_page_shows_the_new_colour_in_chromium(sprite_page):
    """The issue's newcomer path: Start with the default "red ball moving right", switch to "blue square moving down"
    on the page, and the frames on screen turn from a red sprite to a blue one within two chunks of the switch
    (judged by ``examples/sprites/judge.py`` on the very images the browser displayed)."""
    from selenium.webdriver.common.by import By
    from sprites import judge

    new = "blue square moving down"
    browser = _browser_or_skip()
    shown: dict[int, tuple[int, np.ndarray]] = {}  # video frame -> (chunk, the image displayed for it)
    prompts: dict[int, str] = {}  # chunk -> the prompt the status says it was made with
    button = lambda name: browser.find_element(By.XPATH, f"//button[normalize-space()='{name}']")  # noqa: E731
    try:
        browser.get(sprite_page)
        _wait(lambda: browser.find_elements(By.XPATH, "//button[normalize-space()='Start']"), what="the page")
        button("Start").click()
        switched = False
        deadline = time.monotonic() + 120

        def past_two_new_chunks() -> bool:  # a frame of the third chunk made with the new prompt is on screen
            made = sorted(chunk for chunk, prompt in prompts.items() if prompt == new)
            return len(made) >= 1 and any(chunk >= made[0] + 2 for chunk, _ in shown.values())

        while not past_two_new_chunks():
            assert time.monotonic() < deadline, f"timed out: chunk prompts {prompts}, frames {sorted(shown)}"
            # the image and the status in one script: both belong to the same update of the page
            src, status = browser.execute_script(
                "const img = document.querySelector('#frame img');"
                "return [img && img.complete ? img.src : null, document.querySelector('#status textarea').value];")
            prompts.update({int(index): prompt for index, _, _, prompt in CHUNK_LINE.findall(status)})
            headline = FRAME_HEADLINE.match(status)
            if src and headline and int(headline.group(1)) not in shown and "/gradio_api/file=" in src:
                shown[int(headline.group(1))] = (int(headline.group(2)), _png(src))
            if not switched and any(chunk >= 1 for chunk, _ in shown.values()):
                browser.find_element(By.CSS_SELECTOR, "#switch textarea").send_keys(new)
                button("Switch prompt").click()
                switched = True
            time.sleep(0.03)
    finally:
        try:
            button("Stop").click()  # the server's stream ends with the test, passed or not
        finally:
            browser.quit()
    first_new = min(chunk for chunk, prompt in prompts.items() if prompt == new)
    assert first_new >= 1 and all(prompts[chunk] == "red ball moving right" for chunk in range(first_new))
    colours = {number: judge.frame_colours(image[None])[0][0] for number, (_, image) in shown.items()}
    before = [colours[n] for n, (chunk, _) in shown.items() if chunk == first_new - 1]
    after = [colours[n] for n, (chunk, _) in shown.items() if first_new <= chunk < first_new + 2]
    assert before and after, sorted(shown)  # frames of both were seen (at 4 fps, most of them)
    assert "red" in before and "blue" not in before, colours  # the page showed the red ball before the switch
    assert "blue" in after, colours  # and a blue sprite within two chunks of it
