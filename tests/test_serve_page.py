"""The stream server as users start it (``python -m diffusers_causal_kv.serve FOLDER``) and its client page in
headless Chromium: the page starts a session, frames arrive and are shown, a prompt switch lands, Stop ends it; the
page requests nothing outside 127.0.0.1 and the server process opens no socket outside the loopback."""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request

import psutil
import pytest
from serve_helpers import free_port, tiny_pipe, wait
from test_stream_app import _browser_or_skip

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD, NEW = "a red ball", "a blue cube on a table"


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The command line's server on a saved tiny pipeline: ``(url, process, first line it printed)``."""
    folder = tmp_path_factory.mktemp("model") / "tiny"
    tiny_pipe().save_pretrained(folder)
    port, log = free_port(), folder.parent / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "diffusers_causal_kv.serve", str(folder), "--port", str(port), "--device", "cpu",
             "--height", "32", "--width", "32", "--max-height", "64", "--max-width", "64",
             "--memory-budget-mib", "64"], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}/"

    def up():
        assert process.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url + "health", timeout=5) as reply:
                return json.load(reply)["default_size"] == [32, 32]
        except OSError:
            return False

    try:
        wait(up, seconds=180, what="the server process")
        yield url, process, process.stdout.readline()
    finally:
        process.terminate()
        process.wait(30)


def test_the_command_line_says_where_it_serves_and_refuses_bad_options(server, capsys):
    from diffusers_causal_kv.serve.__main__ import main

    url, _, printed = server
    assert printed.startswith("serving ") and f" on {url} (budget 64 MiB of cache)" in printed
    with pytest.raises(SystemExit) as refused:
        main(["folder", "--max-sessions", "0"])
    assert refused.value.code == 2 and "--max-sessions must be positive, got 0." in capsys.readouterr().err


def test_the_page_starts_switches_and_stops_a_session_in_chromium_requesting_nothing_outside(server):
    from selenium.webdriver.common.by import By

    url, process, _ = server
    browser = _browser_or_skip()
    try:
        browser.get(url)
        status = lambda: browser.find_element(By.ID, "status").text  # noqa: E731
        log = lambda: browser.find_element(By.ID, "log").text  # noqa: E731
        _wait = lambda condition, what: wait(condition, seconds=120, what=what)  # noqa: E731
        _wait(lambda: status().startswith("connected"), "the page to connect")
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(OLD)
        browser.find_element(By.ID, "start").click()

        def frame_shown():
            return browser.execute_script("const img = document.getElementById('frame'); return img.complete && "
                                          "img.naturalWidth === 32 && img.src.startsWith('blob:');")

        _wait(frame_shown, "a frame on the page")
        _wait(lambda: re.search(r"chunk 1 · .* prompt: " + OLD, log()), "two chunks")
        prompt.clear()
        prompt.send_keys(NEW)
        browser.find_element(By.ID, "switch").click()
        _wait(lambda: "switched from chunk" in log() and f"prompt: {NEW}" in log(), "a chunk made with the new prompt")
        browser.find_element(By.ID, "stop").click()
        _wait(lambda: status().startswith("stopped after "), "the page to show the session stopped")
        assert browser.find_element(By.ID, "start").is_enabled()
        events = [json.loads(entry["message"])["message"] for entry in browser.get_log("performance")]
    finally:
        browser.quit()
    urls = [e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"]
    urls += [e["params"]["url"] for e in events if e["method"] == "Network.webSocketCreated"]
    assert any(u.startswith(f"ws://127.0.0.1:{url.split(':')[2]}") for u in urls)
    outside = [u for u in urls if not re.match(r"(https?|wss?)://127\.0\.0\.1(:\d+)?/|data:|blob:", u)]
    assert outside == []
    sockets = psutil.Process(process.pid).net_connections(kind="inet")
    assert sockets and all(_loopback(s.laddr.ip) and (not s.raddr or _loopback(s.raddr.ip)) for s in sockets)
