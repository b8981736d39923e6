"""Storage formats of cached K/V: as computed (the default), or fp8 with scales (``kv_dtype=torch.float8_e4m3fn``).

An engine built with ``kv_dtype`` keeps every self and cross entry in that format: :class:`~.base.BaseKVCacheEngine`
encodes the K/V a commit stores and decodes what a pass reads, around the storage hooks, so the engines' own code
(lists, static buffers, rings) stores encoded tensors like any other K/V.

fp8 format (:class:`Float8Storage`)
    A tensor ``[batch, tokens, heads, head_dim]`` is cut into frames of ``frame_tokens`` tokens (a latent frame of a
    self entry; the whole conditioning of a cross entry) and each frame into groups of :data:`GROUP_TOKENS` tokens
    (the last one shorter). Each group has one float32 scale per batch row and head, ``scale = amax / code_max``
    (``code_max``: 448 for e4m3, 57344 for e5m2; an all-zero group gets scale 1), and stores ``x / scale`` rounded to
    the fp8 format. Stored is one ``uint8`` tensor ``[batch, tokens, heads, head_dim + extra]``: per token and head the
    ``head_dim`` bytes of its codes, then ``extra`` bytes holding, over a frame's tokens, the frame's scales
    (``extra = ceil(4 x groups / frame_tokens)``: one byte per token and head for frames of 4 tokens or more).

    Engines slice, ring-write and crop their storage along the token axis by whole frames and never look inside the
    last axis, so each frame's scales travel with its codes through every engine unchanged. Reads dequantize into the
    tag's dtype (``codes x scale``, in float32): fresh tensors, so no-grad passes attend over a copy (the static
    engine's zero-copy views need the stored dtype) and gradient passes read dequantized copies as before.

Why groups of 64 tokens
    An fp8 code is a float: its relative rounding error, at most 2^-4 for e4m3 (3 mantissa bits) and 2^-3 for e5m2,
    does not depend on the scale. The scale only has to bring a group into the format's range, and values down to
    2^-15 of the group's largest (e4m3's normal range) keep that precision, a spread the K/V of one head over 64
    tokens stay well within. Smaller groups therefore buy almost no accuracy, and larger ones save nothing: a frame's
    scales fit its one byte per token and head for any group of at least 4 tokens. 64 tokens is the tile of the
    block-scaled fp8 attention kernels, and a Wan-1.3B frame at 480p (1560 tokens) needs 25 scales per head.

Memory of an fp8 entry: ``2 x batch x tokens x heads x (head_dim + extra)`` bytes, against ``2 x batch x tokens x heads
x head_dim x 2`` in bf16: ``(head_dim + 1) / (2 x head_dim)``, 0.508x for ``head_dim=64``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: Tokens of one scale group (within a frame).
GROUP_TOKENS = 64
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_BYTES = 4  # float32


class KVStorage:
    """K/V stored as computed, in the pass dtype (``kv_dtype=None``): every method hands its tensor back as it is."""

    kv_dtype: torch.dtype | None = None

    def encode(self, tensor: torch.Tensor, frame_tokens: int | None = None) -> torch.Tensor:
        """The stored form of ``tensor`` (``[batch, tokens, heads, head_dim]``) whose frames have ``frame_tokens``
        tokens (``None``: one frame of all its tokens)."""
        return tensor

    def encoded_like(self, tensor: torch.Tensor, frame_tokens: int) -> torch.Tensor:
        """A tensor of the shape, dtype and device :meth:`encode` gives, without computing it (what storage is
        allocated from)."""
        return tensor

    def decode(self, stored: torch.Tensor, frame_tokens: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The K/V ``stored`` holds, in ``dtype``."""
        return stored


class Float8Storage(KVStorage):
    """fp8 codes with a float32 scale per frame, head and group of :data:`GROUP_TOKENS` tokens (module docstring)."""

    def __init__(self, kv_dtype: torch.dtype) -> None:
        self.kv_dtype = kv_dtype
        self.code_max = torch.finfo(kv_dtype).max

    def encode(self, tensor: torch.Tensor, frame_tokens: int | None = None) -> torch.Tensor:
        batch, tokens, heads, head_dim = tensor.shape
        frame_tokens = frame_tokens or tokens
        groups, extra = _layout(frame_tokens)
        x = tensor.float().unflatten(1, (tokens // frame_tokens, frame_tokens))  # [batch, frames, tokens, heads, dim]
        token_amax = F.pad(x.abs().amax(-1), (0, 0, 0, groups * GROUP_TOKENS - frame_tokens))
        scales = token_amax.unflatten(2, (groups, GROUP_TOKENS)).amax(3) / self.code_max  # [b, f, groups, heads]
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (x / _per_token(scales, frame_tokens)).clamp_(-self.code_max, self.code_max).to(self.kv_dtype)
        scale_bytes = _reinterpret(scales.transpose(2, 3), torch.uint8)  # [b, f, heads, 4 x groups]
        scale_bytes = F.pad(scale_bytes, (0, frame_tokens * extra - scale_bytes.shape[-1]))
        scale_bytes = scale_bytes.unflatten(3, (frame_tokens, extra)).transpose(2, 3)  # [b, f, tokens, heads, extra]
        return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1).flatten(1, 2)

    def encoded_like(self, tensor: torch.Tensor, frame_tokens: int) -> torch.Tensor:
        shape = (*tensor.shape[:-1], tensor.shape[-1] + _layout(frame_tokens)[1])
        return torch.empty((), dtype=torch.uint8, device=tensor.device).expand(shape)

    def decode(self, stored: torch.Tensor, frame_tokens: int | None, dtype: torch.dtype) -> torch.Tensor:
        tokens = stored.shape[1]
        frame_tokens = frame_tokens or tokens
        groups, extra = _layout(frame_tokens)
        packed = stored.unflatten(1, (tokens // frame_tokens, frame_tokens))  # [batch, frames, tokens, heads, bytes]
        codes = packed[..., :-extra].view(self.kv_dtype)
        scale_bytes = packed[..., -extra:].transpose(2, 3).flatten(3)[..., : _SCALE_BYTES * groups]
        scales = _reinterpret(scale_bytes, torch.float32).transpose(2, 3)  # [batch, frames, groups, heads]
        return (codes.float() * _per_token(scales, frame_tokens)).to(dtype).flatten(1, 2)


def kv_storage(kv_dtype: torch.dtype | None) -> KVStorage:
    """The storage of an engine built with ``kv_dtype``; raises for a dtype it cannot store in."""
    if kv_dtype is None:
        return KVStorage()
    if kv_dtype not in FLOAT8_DTYPES:
        raise ValueError(
            f"kv_dtype must be None (K/V stored in the dtype they are computed in) or one of "
            f"{', '.join(map(str, FLOAT8_DTYPES))} (fp8 with scales), got {kv_dtype!r}; to cache in bf16, run the "
            "model in bf16 with kv_dtype=None."
        )
    return Float8Storage(kv_dtype)


def _layout(frame_tokens: int) -> tuple[int, int]:
    """Scale groups per frame, and extra bytes per token and head holding the frame's scales."""
    groups = math.ceil(frame_tokens / GROUP_TOKENS)
    return groups, math.ceil(_SCALE_BYTES * groups / frame_tokens)


def _per_token(scales: torch.Tensor, frame_tokens: int) -> torch.Tensor:
    """``[batch, frames, groups, heads]`` scales as ``[batch, frames, tokens, heads, 1]``."""
    return scales.repeat_interleave(GROUP_TOKENS, dim=2)[:, :, :frame_tokens, :, None]


def _reinterpret(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``tensor`` read as ``dtype`` along the last axis (copied into row-major strides first, which
    ``.contiguous()`` leaves alone on size-1 axes)."""
    return tensor.new_empty(tensor.shape).copy_(tensor).view(dtype)
