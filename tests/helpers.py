"""Forward shortcuts, cache snapshots, and the references the tests compare against (the references run stock
diffusers code only). The tiny random models and their inputs come from :mod:`diffusers_causal_kv.testing`."""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch

from diffusers_causal_kv import CausalContext
from diffusers_causal_kv.testing import (  # noqa: F401 (re-exported: the tests import them from here)
    I2V_TEXT_LEN,
    TEXT_DIM,
    VACE_CHANNELS,
    MaskedStockProcessor,
    tiny_vace,
    tiny_wan,
)
from diffusers_causal_kv.testing import tiny_conditioning as conditioning  # noqa: F401


def block_causal_mask(chunk_frames: list[int], frame_tokens: int) -> torch.Tensor:
    """Hand-written dense mask: token i attends to token j iff j's chunk is not after i's chunk."""
    chunk_of_token = []
    for idx, size in enumerate(chunk_frames):
        chunk_of_token += [idx] * (size * frame_tokens)
    c = torch.tensor(chunk_of_token)
    return c[None, :] <= c[:, None]


def masked_full_forward(model, hidden_states, timestep, text, image, mask, **extra):
    """One stock forward over the whole sequence with ``mask`` on every self-attention, of the main and (VACE)
    control streams alike (no plugin involved). ``extra`` goes to the forward (e.g. control latents)."""
    saved = model.attn_processors
    model.set_attn_processor(MaskedStockProcessor(mask))
    try:
        return model(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=text,
                     encoder_hidden_states_image=image, return_dict=False, **extra)[0]
    finally:
        model.set_attn_processor(saved)


def forward(model, x, t, text, image=None, extra=None, **ctx):
    """One no-grad forward of ``model``, under a ``CausalContext(model, **ctx)`` when ``ctx`` is given; ``extra``
    holds further forward arguments (VACE control latents)."""
    with torch.no_grad(), (CausalContext(model, **ctx) if ctx else contextlib.nullcontext()):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image,
                     return_dict=False, **(extra or {}))[0]


def cache_snapshot(model) -> dict:
    """Everything observable about the engines of ``model``: frames, cross flags, bytes and tensor values."""
    snap = {}
    for branch, engine in model.kv_cache_engines.items():
        tensors = []
        for block in sorted(engine._self_kv):
            for tag in sorted(engine._self_kv[block]):
                prefix = engine.get_self_prefix(block, tag)
                tensors += [] if prefix is None else [t.clone() for t in prefix]
        for block in sorted(engine._cross_kv):
            for tag in sorted(engine._cross_kv[block]):
                tensors += [t.clone() for t in engine._cross_kv[block][tag].tensors()]
        snap[branch] = (
            {tag: (engine.num_frames(tag), engine.is_cross_init(tag)) for tag in engine.tags()},
            engine.memory_bytes(),
            tensors,
        )
    return snap


def assert_same_snapshot(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for branch in before:
        (meta_a, bytes_a, tensors_a), (meta_b, bytes_b, tensors_b) = before[branch], after[branch]
        assert meta_a == meta_b and bytes_a == bytes_b and len(tensors_a) == len(tensors_b)
        assert all(same_tensor(a, b) for a, b in zip(tensors_a, tensors_b))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` that also takes float8 tensors (which it refuses on CPU): same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def window_mask(chunk_frames: list[int], frame_tokens: int, window_frames: int, sink_frames: int = 0) -> torch.Tensor:
    """Hand-written dense mask of a rolling window with attention sinks: a token of chunk k (frames [s, s + c))
    attends to its own chunk, to earlier frames < ``sink_frames`` and to the earlier frames
    >= s - (window_frames - sink_frames - c)."""
    allowed = []
    start = 0
    for size in chunk_frames:
        reach = window_frames - sink_frames - size
        row = [start <= f < start + size or (f < start and (f < sink_frames or f >= start - reach))
               for f in range(sum(chunk_frames))]
        allowed += [row] * size
        start += size
    frames = torch.tensor(allowed)
    return frames.repeat_interleave(frame_tokens, 0).repeat_interleave(frame_tokens, 1)


def causal_outputs(model, text, chunks, t: float = 500.0) -> list[torch.Tensor]:
    """A cached rollout of ``chunks`` (one latent frame each): every chunk after the first denoised at ``t`` against
    the cache, each chunk committed at t=0; the denoising outputs."""
    from diffusers_causal_kv import clear_caches

    clear_caches(model)
    batch = chunks[0].shape[0]
    outs = []
    for k, x in enumerate(chunks):
        if k:
            outs.append(forward(model, x, torch.full((batch,), t), text, start_frame=k))
        forward(model, x, torch.zeros(batch), text, start_frame=k, store_kv=True)
    return outs


def masked_outputs(model, text, chunks, t: float = 500.0) -> list[torch.Tensor]:
    """The reference of :func:`causal_outputs`: for each chunk after the first, one masked full-sequence stock
    forward over the chunks up to it (per-token timesteps 0 for the committed ones, ``t`` for it)."""
    batch, frame_tokens = chunks[0].shape[0], chunks[0].shape[-2] * chunks[0].shape[-1] // 4
    outs = []
    for k in range(1, len(chunks)):
        per_token = torch.cat([torch.zeros(batch, frame_tokens * k), torch.full((batch, frame_tokens), t)], dim=1)
        with torch.no_grad():
            full = masked_full_forward(model, torch.cat(chunks[:k + 1], dim=2), per_token, text, None,
                                       block_causal_mask([1] * (k + 1), frame_tokens))
        outs.append(full[:, :, k:])
    return outs


def _local(host) -> bool:
    return str(host).startswith(("127.", "::1", "localhost"))


@contextlib.contextmanager
def loopback_only():
    """Refuse and record every connection or name lookup of this process to anything but the loopback; none may
    have happened."""
    outside = []
    connect_, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def local_connect(sock, address):
        if isinstance(address, tuple) and not _local(address[0]):
            outside.append(address)
            raise OSError(f"test: no connection outside the machine ({address})")
        return connect_(sock, address)

    def local_getaddrinfo(host, *args, **kwargs):
        if host is not None and not _local(host):
            outside.append(host)
            raise socket.gaierror(f"test: no name lookup outside the machine ({host})")
        return getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", local_connect)
        patch.setattr(socket, "getaddrinfo", local_getaddrinfo)
        yield
    assert outside == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
