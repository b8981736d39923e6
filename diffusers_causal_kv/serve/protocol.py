"""The streaming protocol: what a client may send, how it is checked, and what the server sends back.

One WebSocket connection (``/ws``, ``?token=...`` when the server has a token) carries one session at a time. The
client sends JSON text messages; the server answers with JSON text messages and, for every chunk, one binary message
per video frame (a PNG). Every request is checked whole before it reaches the session table, so a request that is
refused changes nothing. The messages are documented in ``docs/serving.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

SWITCH_MODES = ("recache", "cross")


class RequestError(ValueError):
    """A request the server refuses; ``code`` names the kind (sent to the client with the message)."""

    def __init__(self, message: str, code: str = "bad_value") -> None:
        super().__init__(message)
        self.code = code

    def to_message(self) -> dict:
        return error_message(self.code, str(self))


def error_message(code: str, message: str, retry_after: float | None = None) -> dict:
    reply = {"type": "error", "code": code, "message": message}
    if retry_after is not None:
        reply["retry_after"] = round(retry_after, 1)
    return reply


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. ``size_multiple`` and ``temporal`` come from the model (its VAE and patch)."""

    max_prompt_chars: int = 500
    max_height: int = 480
    max_width: int = 832
    max_frames: int | None = None
    """Video frames per session; ``None``: a session may stream until it is stopped."""
    max_chunk_frames: int = 4
    """Latent frames per chunk."""
    max_guidance_scale: float = 20.0
    max_message_bytes: int = 4096
    size_multiple: int = 16
    temporal: int = 4


@dataclass(frozen=True)
class StartRequest:
    """A checked ``start`` message; ``None`` fields take the model's defaults (its ``causal_config``)."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    chunk_frames: int | None = None
    guidance_scale: float | None = None
    prompt_switch: str = "recache"


@dataclass(frozen=True)
class SwitchRequest:
    prompt: str
    negative_prompt: str | None = None
    mode: str | None = None


@dataclass(frozen=True)
class StopRequest:
    pass


_FIELDS = {
    "start": {"type", "prompt", "negative_prompt", "seed", "height", "width", "num_frames", "chunk_frames",
              "guidance_scale", "prompt_switch"},
    "switch": {"type", "prompt", "negative_prompt", "mode"},
    "stop": {"type"},
}


@dataclass
class RequestParser:
    """Turns a client's text message into a request, or raises :class:`RequestError` naming what is wrong and the
    accepted values."""

    limits: Limits
    default_size: tuple[int, int] = field(default=(480, 832))

    def parse(self, text: str) -> StartRequest | SwitchRequest | StopRequest:
        if len(text.encode()) > self.limits.max_message_bytes:
            raise RequestError(f"a message holds at most {self.limits.max_message_bytes} bytes; "
                               "send a shorter prompt.", "too_large")
        try:
            message = json.loads(text)
        except ValueError as error:
            raise RequestError(f"a message must be one JSON object ({error}).", "bad_json") from None
        if not isinstance(message, dict):
            raise RequestError("a message must be one JSON object, e.g. {\"type\": \"stop\"}.", "bad_json")
        kind = message.get("type")
        if kind not in _FIELDS:
            raise RequestError(f"type must be one of {sorted(_FIELDS)}, got {kind!r}.", "unknown_type")
        unknown = sorted(set(message) - _FIELDS[kind])
        if unknown:
            raise RequestError(f"a {kind!r} message takes the fields {sorted(_FIELDS[kind])}; "
                               f"drop {unknown}.", "unknown_field")
        if kind == "stop":
            return StopRequest()
        if kind == "switch":
            return SwitchRequest(self._prompt(message, "prompt"), self._prompt(message, "negative_prompt", None),
                                 self._choice(message, "mode", SWITCH_MODES, None))
        return self._start(message)

    def _start(self, message: dict) -> StartRequest:
        limits = self.limits
        height = self._int(message, "height", self.default_size[0], limits.size_multiple, limits.max_height)
        width = self._int(message, "width", self.default_size[1], limits.size_multiple, limits.max_width)
        for name, size in (("height", height), ("width", width)):
            if size % limits.size_multiple:
                raise RequestError(f"{name} must be a multiple of {limits.size_multiple}, got {size}.")
        num_frames = self._int(message, "num_frames", limits.max_frames, 1, limits.max_frames,
                               none_ok=limits.max_frames is None)
        if num_frames is not None and (num_frames - 1) % limits.temporal:
            raise RequestError(f"num_frames must be {limits.temporal}k + 1 video frames (1, "
                               f"{limits.temporal + 1}, {2 * limits.temporal + 1}, ...), got {num_frames}.")
        guidance = message.get("guidance_scale")
        if guidance is not None and (isinstance(guidance, bool) or not isinstance(guidance, (int, float))
                                     or not math.isfinite(guidance) or not 1 <= guidance <= limits.max_guidance_scale):
            raise RequestError(f"guidance_scale must be a number from 1 to {limits.max_guidance_scale}, "
                               f"got {guidance!r}.")
        return StartRequest(
            prompt=self._prompt(message, "prompt"), negative_prompt=self._prompt(message, "negative_prompt", None),
            seed=self._int(message, "seed", 0, 0, 2**63 - 1), height=height, width=width, num_frames=num_frames,
            chunk_frames=self._int(message, "chunk_frames", None, 1, limits.max_chunk_frames, none_ok=True),
            guidance_scale=None if guidance is None else float(guidance),
            prompt_switch=self._choice(message, "prompt_switch", SWITCH_MODES, "recache"))

    def _prompt(self, message: dict, name: str, default: object = ...) -> str | None:
        if name not in message or message[name] is None:
            if default is ...:
                raise RequestError(f"{name} is required: a non-empty string.")
            return default
        text = message[name]
        if not isinstance(text, str) or (default is ... and not text.strip()):
            raise RequestError(f"{name} must be a non-empty string, got {text!r}.")
        if len(text) > self.limits.max_prompt_chars:
            raise RequestError(f"{name} holds at most {self.limits.max_prompt_chars} characters, got "
                               f"{len(text)}.", "too_large")
        return text

    @staticmethod
    def _int(message: dict, name: str, default, lowest: int, highest: int | None, none_ok: bool = False):
        if name not in message:
            return default
        value = message[name]
        if value is None and none_ok:
            return None
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole or value < lowest or (highest is not None and value > highest):
            upper = "" if highest is None else f" to {highest}"
            code = "too_large" if whole and value > lowest else "bad_value"
            raise RequestError(f"{name} must be an integer from {lowest}{upper}, got {value!r}.", code)
        return value

    @staticmethod
    def _choice(message: dict, name: str, choices: tuple[str, ...], default: str | None) -> str | None:
        value = message.get(name, default)
        if value is not None and value not in choices:
            raise RequestError(f"{name} must be one of {list(choices)}, got {value!r}.")
        return value
