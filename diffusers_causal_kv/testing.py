"""Tiny random Wan models and inputs for tests, examples and benchmarks (as diffusers ships ``testing_utils``).

Everything here is built from a config in memory; nothing is ever downloaded. The sizes default to the tiny config of
diffusers' own Wan tests (2 heads x 12, 2 layers, text dim 32), so a model builds and runs on a CPU in milliseconds;
every size is a keyword argument, so the same factory builds the benchmark presets (up to the Wan2.1-1.3B shape).

Only torch and diffusers are imported, nothing of the plugin: a reference built here (:class:`MaskedStockProcessor`)
runs stock diffusers code only.

:func:`doc_namespace` builds the objects the examples of the README and of the documentation take as the reader's
own (a pipeline, latents, prompt embeddings), so a reader can run any example as written, as the tests do.
"""

from __future__ import annotations

import contextlib
import math
import string

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
)
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from diffusers.video_processor import VideoProcessor

__all__ = [
    "I2V_TEXT_LEN",
    "TEXT_DIM",
    "VACE_CHANNELS",
    "MaskedStockProcessor",
    "decode_latents",
    "doc_namespace",
    "tiny_conditioning",
    "tiny_pipeline_components",
    "tiny_prompt_encoder",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_vace",
    "tiny_vae",
    "tiny_wan",
    "tiny_wan22_vae",
]

TEXT_DIM = 32  # text embedding width of the tiny models
I2V_TEXT_LEN = 512  # stock Wan2.1 I2V splits the image tokens off assuming 512 text tokens
VACE_CHANNELS = 24  # control-latent channels of the default tiny VACE model
PROMPT_LEN = 16  # tokens per prompt of tiny_prompt_encoder


def _tiny_config(heads: int, head_dim: int, layers: int, in_channels: int, rope_max_seq_len: int) -> dict:
    return dict(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=in_channels,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=rope_max_seq_len,
    )


def _build(cls, config: dict, seed: int, init, device, dtype):
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = cls(**config)
    with torch.no_grad():
        if init == "fan_in":  # unit-variance activations at any size (the benchmarks' init)
            for param in model.parameters():
                if param.ndim >= 2:
                    param.normal_(0.0, 1.0 / math.sqrt(param[0].numel()))
                elif not param.any():
                    param.normal_(0.0, 0.02)
        elif init is not None:  # random weights everywhere, the zero-initialised ones too, so every path matters
            for param in model.parameters():
                param.copy_(torch.randn_like(param) * init)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def tiny_wan(head_dim: int = 12, heads: int = 2, layers: int = 2, i2v: bool = False, seed: int = 0,
             rope_max_seq_len: int = 32, in_channels: int = 16, *, init: float | str | None = 0.2,
             device: str | torch.device | None = None, dtype: torch.dtype | None = None,
             **config) -> WanTransformer3DModel:
    """A tiny random ``WanTransformer3DModel`` in eval mode (T2V, or Wan2.1 I2V with ``i2v=True``).

    Args:
        head_dim, heads, layers: attention head size, head count and number of transformer blocks.
        i2v: a Wan2.1 I2V model: image embeddings of width 8 (``image_dim``), their own K/V projections in
            cross-attention, and 20 more input channels (mask and image latents).
        seed: ``torch.manual_seed(seed)`` runs before the model is built, so the weights are reproducible.
        rope_max_seq_len: positions in the RoPE table (latent frames the model can address).
        in_channels: latent input channels (of T2V; I2V adds 20).
        init: ``0.2`` (default) replaces every parameter, the zero-initialised ones included, by standard normal
            noise times this scale; ``"fan_in"`` draws matrices from ``N(0, 1/fan_in)`` and zero vectors from
            ``N(0, 0.02^2)`` (activations stay O(1) at any size: the benchmarks' init); ``None`` keeps diffusers'
            own initialisation.
        device: where the parameters are created (and drawn), e.g. ``"cuda"``; default: torch's default device.
        dtype: cast after the (fp32) initialisation; default fp32.
        **config: any other ``WanTransformer3DModel`` argument, overriding the tiny defaults (``out_channels=16,
            text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, patch_size=(1, 2, 2), cross_attn_norm=True,
            qk_norm="rms_norm_across_heads"``), e.g. ``ffn_dim=64`` or ``text_dim=4096``.
    """
    kwargs = _tiny_config(heads, head_dim, layers, in_channels, rope_max_seq_len)
    if i2v:
        kwargs.update(image_dim=8, added_kv_proj_dim=heads * head_dim, in_channels=in_channels + 20)
    kwargs.update(config)
    return _build(WanTransformer3DModel, kwargs, seed, init, device, dtype)


def tiny_vace(vace_layers=(0, 2), layers: int = 3, seed: int = 0, head_dim: int = 12, heads: int = 2, *,
              init: float | str | None = 0.2, device: str | torch.device | None = None,
              dtype: torch.dtype | None = None, **config) -> WanVACETransformer3DModel:
    """A tiny random ``WanVACETransformer3DModel`` in eval mode: :func:`tiny_wan`'s config (and ``seed``, ``init``,
    ``device``, ``dtype``) plus VACE control blocks after the main blocks ``vace_layers`` (the default ``[0, 2]``
    of 3 is not contiguous), taking ``VACE_CHANNELS`` control-latent channels (``vace_in_channels=...`` in
    ``config`` overrides it, e.g. 96 for the stock pipeline's video latents and 8x8 mask)."""
    kwargs = _tiny_config(heads, head_dim, layers, 16, 32)
    kwargs.update(vace_layers=list(vace_layers), vace_in_channels=VACE_CHANNELS)
    kwargs.update(config)
    return _build(WanVACETransformer3DModel, kwargs, seed, init, device, dtype)


def tiny_conditioning(model, batch: int = 2, text_len: int = 12, image_tokens: int = 4, seed: int = 1):
    """Random ``(encoder_hidden_states, encoder_hidden_states_image)`` for ``model`` (the image part ``None``
    unless ``model`` is an I2V model, whose text is then ``I2V_TEXT_LEN`` tokens long), drawn from a generator
    seeded with ``seed`` (the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    is_i2v = model.config.image_dim is not None
    text = torch.randn(batch, I2V_TEXT_LEN if is_i2v else text_len, model.config.text_dim, generator=g)
    image = torch.randn(batch, image_tokens, model.config.image_dim, generator=g) if is_i2v else None
    return text, image


def tiny_vae(seed: int | None = None) -> AutoencoderKLWan:
    """A tiny random ``AutoencoderKLWan`` with the real model's compression (8x spatial, 4x temporal, 16 latent
    channels) and default latent statistics. ``seed=None`` draws the weights from the global RNG as it stands
    (e.g. right after a model built with a seed)."""
    if seed is not None:
        torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def tiny_wan22_vae(seed: int | None = None) -> AutoencoderKLWan:
    """A tiny random ``AutoencoderKLWan`` with the Wan2.2 (TI2V-5B) VAE's structure: residual blocks, 2x2 patchified
    pixels (12 input channels), 16x spatial and 4x temporal compression, 48 latent channels (latent statistics 0 and
    1). Pair it with ``tiny_wan(in_channels=48, out_channels=48)`` and ``expand_timesteps=True``."""
    if seed is not None:
        torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16,
                            latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


def tiny_prompt_encoder(prompt: str, batch: int = 1, text_len: int = PROMPT_LEN,
                        text_dim: int = TEXT_DIM) -> torch.Tensor:
    """Stands in for the T5 encoder of the tiny models: ``[batch, text_len, text_dim]`` random embeddings,
    deterministic per prompt (the same prompt always gives the same embeddings, different prompts differ)."""
    g = torch.Generator().manual_seed(sum(map(ord, prompt)))
    return torch.randn(batch, text_len, text_dim, generator=g)


def decode_latents(vae: AutoencoderKLWan, latents: torch.Tensor):
    """Un-normalise Wan latents ``[1, C, F, H, W]`` with the VAE's ``latents_mean``/``latents_std``, decode them and
    return the video as a numpy array of frames ``[frames, height, width, 3]`` in 0..1 (for ``export_to_video``)."""
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
    latents = latents.to(vae.dtype) * std.to(vae.dtype) + mean.to(vae.dtype)
    with torch.no_grad():
        video = vae.decode(latents, return_dict=False)[0]
    return VideoProcessor(vae_scale_factor=8).postprocess_video(video.float(), output_type="np")[0]


class MaskedStockProcessor(WanAttnProcessor):
    """The stock ``WanAttnProcessor`` with a fixed self-attention mask: the reference full-sequence forward.

    ``mask`` (a dense boolean ``[tokens, tokens]``, ``True`` = attend, or ``None`` for bidirectional) is applied to
    every self-attention; cross-attention runs unmasked, as stock. The attribute may be reassigned between forwards
    (one instance serves every block). Install with ``model.set_attn_processor(MaskedStockProcessor(mask))``.
    """

    def __init__(self, mask: torch.Tensor | None = None):
        super().__init__()
        self.mask = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        mask = self.mask if encoder_hidden_states is None else None
        return super().__call__(attn, hidden_states, encoder_hidden_states, mask, rotary_emb)


def tiny_tokenizer():
    """A character-level tokenizer built in code (nothing downloaded) that behaves like the T5 tokenizer the Wan
    pipelines call: lower-cased characters, ``</s>`` appended, ``<pad>`` padding, ``<unk>`` for anything unknown."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = " " + string.ascii_lowercase + string.digits + string.punctuation
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(symbols)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_text_encoder(seed: int = 0, text_dim: int = TEXT_DIM):
    """A tiny random ``UMT5EncoderModel`` (the Wan text encoder's class) whose width is the tiny models' text dim,
    with :func:`tiny_tokenizer`'s vocabulary."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=len(tiny_tokenizer()), d_model=text_dim, d_kv=8, d_ff=2 * text_dim, num_layers=1,
                        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    torch.manual_seed(seed)
    return UMT5EncoderModel(config).eval()


def tiny_pipeline_components(transformer=None, seed: int = 0) -> dict:
    """Components for ``CausalWanPipeline(**components)`` (or the stock Wan pipelines): a tiny transformer
    (:func:`tiny_wan` unless given), :func:`tiny_vae`, :func:`tiny_text_encoder`, :func:`tiny_tokenizer` and a
    flow-matching scheduler with Wan's shift."""
    return {
        "transformer": tiny_wan(seed=seed) if transformer is None else transformer,
        "vae": tiny_vae(seed=seed),
        "text_encoder": tiny_text_encoder(seed=seed),
        "tokenizer": tiny_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
    }


def _doc_latents(frames: int, seed: int) -> torch.Tensor:
    """``[1, 16, frames, 8, 8]`` latents (16 tokens per latent frame after the 1x2x2 patch), drawn from ``seed``."""
    return torch.randn(1, 16, frames, 8, 8, generator=torch.Generator().manual_seed(seed))


def doc_namespace(processor=None) -> dict:
    """The objects the Python examples of the README and the docs take as the reader's own, tiny, random and new.

    The examples start from what a reader already has: a diffusers Wan pipeline, its transformer, latents and
    prompt embeddings. This builds each of them tiny (nothing is downloaded; everything runs on a CPU in seconds),
    under the name the examples use. The tests run every example of a page in such a namespace, and a reader can
    do the same::

        from diffusers_causal_kv.testing import doc_namespace

        globals().update(doc_namespace())  # then paste an example

    Args:
        processor: an attention processor to install on ``transformer`` first, for the examples whose page says
            the causal processors are already installed (``doc_namespace(CausalWanAttnProcessor())``); default
            none: the stock model.

    Returns:
        A new dict on every call, whose entries are:

        * ``transformer``: a tiny stock ``WanTransformer3DModel`` (:func:`tiny_wan`, 2 heads x 12, 2 layers);
        * ``pipe``: a ``WanPipeline`` around ``transformer``, with a tiny text encoder, tokenizer and VAE
          (:func:`tiny_pipeline_components`) and a ``FlowMatchEulerDiscreteScheduler``, so prompts run to frames;
        * ``batch``: 1;
        * ``noise``, ``clean``: latents ``[1, 16, 6, 8, 8]`` (6 latent frames of 8x8, 16 tokens per frame);
        * ``chunk``, ``clean_chunk``: latents of 3 frames; ``clip_latents``: latents of 2 frames;
        * ``first_half``, ``second_half``: lists of two one-frame latents each;
        * ``prompt_embeds`` and ``text`` (one tensor under two names), ``negative_embeds``, ``new_prompt_embeds``:
          text embeddings ``[1, 12, 32]`` (:func:`tiny_conditioning`);
        * ``dmd_loss(latents, exit_steps)``: stands in for a distillation loss (DMD): the mean square of
          ``latents``.

        Each latent and embedding is drawn from a seed of its own, so the namespace is the same on every call.
    """
    transformer = tiny_wan()
    if processor is not None:
        transformer.set_attn_processor(processor)
    text = tiny_conditioning(transformer, batch=1, seed=1)[0]
    components = {**tiny_pipeline_components(transformer), "scheduler": FlowMatchEulerDiscreteScheduler()}
    return {
        "transformer": transformer,
        "pipe": WanPipeline(**components),
        "batch": 1,
        "noise": _doc_latents(6, 0),
        "clean": _doc_latents(6, 1),
        "chunk": _doc_latents(3, 2),
        "clean_chunk": _doc_latents(3, 3),
        "clip_latents": _doc_latents(2, 4),
        "first_half": [_doc_latents(1, 10 + i) for i in range(2)],
        "second_half": [_doc_latents(1, 20 + i) for i in range(2)],
        "prompt_embeds": text,
        "text": text,
        "negative_embeds": tiny_conditioning(transformer, batch=1, seed=2)[0],
        "new_prompt_embeds": tiny_conditioning(transformer, batch=1, seed=3)[0],
        "dmd_loss": lambda latents, exit_steps: latents.square().mean(),
    }
