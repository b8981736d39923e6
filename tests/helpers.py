"""Tiny random Wan models, forward shortcuts, cache snapshots, and the references the tests compare against
(the references run stock diffusers code only)."""

from __future__ import annotations

import contextlib

import torch
from diffusers import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffusers_causal_kv import CausalContext

TEXT_DIM = 32
I2V_TEXT_LEN = 512  # stock I2V splits the image tokens off assuming 512 text tokens
VACE_CHANNELS = 24


def tiny_wan(head_dim: int = 12, heads: int = 2, layers: int = 2, i2v: bool = False, seed: int = 0,
             rope_max_seq_len: int = 32, in_channels: int = 16, **config) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    kwargs = dict(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=in_channels,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=rope_max_seq_len,
    )
    if i2v:
        kwargs.update(image_dim=8, added_kv_proj_dim=heads * head_dim, in_channels=in_channels + 20)
    kwargs.update(config)
    model = WanTransformer3DModel(**kwargs).eval()
    # Random weights everywhere, including the zero-initialised ones, so every path matters numerically.
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model


def tiny_vace(vace_layers=(0, 2), layers: int = 3, seed: int = 0, head_dim: int = 12, heads: int = 2,
              **config) -> WanVACETransformer3DModel:
    """A tiny random VACE transformer; the default VACE layers [0, 2] of 3 are not contiguous."""
    torch.manual_seed(seed)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=list(vace_layers),
        vace_in_channels=VACE_CHANNELS, **config,
    ).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model


def conditioning(model, batch: int = 2, text_len: int = 12, image_tokens: int = 4, seed: int = 1):
    """(encoder_hidden_states, encoder_hidden_states_image or None) for ``model``."""
    g = torch.Generator().manual_seed(seed)
    is_i2v = model.config.image_dim is not None
    text = torch.randn(batch, I2V_TEXT_LEN if is_i2v else text_len, TEXT_DIM, generator=g)
    image = torch.randn(batch, image_tokens, model.config.image_dim, generator=g) if is_i2v else None
    return text, image


class MaskedStockProcessor:
    """The stock processor with a fixed self-attention mask: the reference full-sequence forward."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.stock = WanAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        mask = self.mask if encoder_hidden_states is None else None
        return self.stock(attn, hidden_states, encoder_hidden_states, mask, rotary_emb)


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
        assert all(torch.equal(a, b) for a, b in zip(tensors_a, tensors_b))


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
