"""Published causal Wan checkpoints -> diffusers model folders with their sampling settings.

``convert_checkpoint(src, out, format="auto", ...)`` (or ``python -m diffusers_causal_kv.convert SRC OUT``) reads a
Self-Forcing, Causal-Forcing (and Causal-Forcing++), CausVid, LongLive (base plus LoRA), LongLive 2.0
(Wan2.2-TI2V-5B), Krea Realtime, Rolling Forcing, FastVideo CausalWan2.2-I2V-A14B (two experts) or original-layout
Wan checkpoint and writes a folder that stock
``WanTransformer3DModel.from_pretrained(out)`` loads (for two experts: ``out/transformer`` and
``out/transformer_2``), plus ``out/causal_config.json`` (:class:`~diffusers_causal_kv.CausalConfig`) with the
sampling settings the checkpoint's authors use. ``FORMATS`` lists the peers, their layouts and settings, with the
sources they were read from (:mod:`.peers`); ``REFUSED`` in :mod:`.peers` the releases refused by name (Reward
Forcing, StreamDiffusionV2, MemFlow) and the mechanism each needs.

fp8 weights are dequantized (:mod:`.quantized`); a LoRA-only checkpoint is merged onto ``base``. The folder is written
all or nothing (:mod:`.output`: beside ``out``, checked, then moved into place; an existing ``out`` only with
``overwrite=True``) and is a Hub model repo, with its model card (:mod:`.card`).

This subpackage imports diffusers, huggingface_hub, torch, safetensors and :mod:`diffusers_causal_kv.causal_config`
only.
"""

from .checkpoint import convert_checkpoint
from .lora import LORA_WEIGHT_NAME
from .peers import FORMATS, PeerFormat

__all__ = ["FORMATS", "LORA_WEIGHT_NAME", "PeerFormat", "convert_checkpoint"]
