"""The sprite model's text path: a word-level tokenizer over the task's words and a tiny UMT5 encoder (the Wan text
encoder's class) on top of it, both built in code and saved with the model.

One token per word is what makes the prompt reach a model this small: with characters, "red" and "right" share a
token and the colour is spread over three positions that a 4-layer transformer has to learn to pool; with words, each
colour, shape and direction is one distinct embedding that cross-attention can pick out. Words outside the task's
vocabulary become ``<unk>``. The encoder is random and frozen at its seed (the transformer's own text projection
learns the rest), so the same prompt always gives the same embeddings.
"""

from __future__ import annotations

from . import task

SPECIAL = ("<pad>", "</s>", "<unk>")
WORDS = (*task.COLOURS, *task.SHAPES, "moving", *task.DIRECTIONS)
TEXT_DIM = 32


def sprite_tokenizer():
    """A ``PreTrainedTokenizerFast``: lower-cased, split on whitespace and punctuation, one id per task word,
    ``</s>`` appended and ``<pad>`` padding, as the T5 tokenizer the Wan pipelines call."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL, *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def sprite_text_encoder(seed: int = 0):
    """A random one-layer ``UMT5EncoderModel`` of width :data:`TEXT_DIM` over :func:`sprite_tokenizer`'s vocabulary,
    in eval mode with its weights frozen."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=len(SPECIAL) + len(WORDS), d_model=TEXT_DIM, d_kv=8, d_ff=2 * TEXT_DIM,
                        num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                        relative_attention_max_distance=16, dropout_rate=0.0)
    torch.manual_seed(seed)
    return UMT5EncoderModel(config).eval().requires_grad_(False)
