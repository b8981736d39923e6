"""Causal, chunk-by-chunk video generation with a KV cache for the stock diffusers Wan transformers.

diffusers-causal-kv makes a stock ``WanTransformer3DModel`` (Wan2.1/2.2 T2V, Wan2.1 I2V) or
``WanVACETransformer3DModel`` causal: the video is generated chunk by chunk of latent frames, each chunk attending
to the keys and values cached for the chunks before it. There is no fork and no patched class, and no weight
changes: it is a set of attention processors plus a context manager per forward. It is meant for Self-Forcing /
CausVid style causal Wan checkpoints, for inference (few-step rollouts, streaming with a bounded rolling cache,
prompt switches) and for training (block-causal and teacher-forcing masks, self-forcing rollouts with gradients).

Usage, given a diffusers ``WanPipeline`` ``pipe``, latent ``noise`` ``[batch, 16, frames, h, w]`` and the text
encoder's ``prompt_embeds``::

    from diffusers_causal_kv import CausalWanAttnProcessor, causal_rollout

    pipe.transformer.set_attn_processor(CausalWanAttnProcessor())  # outside a context: exactly the stock model
    result = causal_rollout(pipe, noise, prompt_embeds, chunk_frames=3, timesteps=[1000, 750, 500, 250])
    latents = result.latents  # decode with pipe.vae as the stock pipeline does

The public names, all importable from here:

* attention and contexts: :class:`CausalWanAttnProcessor`, :class:`CausalContext` (one forward: its start
  frame, cache tag, whether it commits), :func:`get_current_context`, :func:`clear_caches`,
  :func:`uninstall_causal_kv`;
* KV-cache engines: :class:`KVCacheEngine` (alias :class:`VanillaKVCacheEngine`, the reference),
  :class:`StaticKVCacheEngine` (preallocated, for speed and ``torch.compile``), :class:`RollingKVCacheEngine`
  (a sliding window with attention sinks, for unbounded length), :class:`BaseKVCacheEngine` (the contract);
* sampling loops: :func:`causal_rollout`, :class:`RolloutOutput`, :func:`chunk_schedule`, :func:`prefill`,
  :func:`recache`, :class:`StreamingRollout`, and :class:`RolloutPlanner`, which they all drive;
* several devices: :func:`causal_cp_plan` (diffusers' context parallelism, frame-aligned),
  :class:`CFGAcrossRanks` (the two guidance passes on two ranks);
* training: :func:`self_forcing_rollout`, :func:`block_causal_mask`, :func:`teacher_forcing_mask`,
  :class:`CausalMask`.

``diffusers_causal_kv.testing`` builds tiny random Wan models for tests and experiments (nothing is downloaded).

Read more: the README (quickstart, the rollout helper, API table, error catalogue, long rollouts, training,
compatibility, performance) at https://github.com/diffusers-causal-kv/diffusers-causal-kv#readme,
``docs/architecture.md`` for the layers and their contracts, and ``examples/`` for runnable scripts.
"""

from . import quiet_imports  # noqa: F401  (first: optional backends imported without their log noise)
from .causal_config import CausalConfig
from .context import CausalContext, get_current_context
from .kv_cache import (
    BaseKVCacheEngine,
    KVCacheEngine,
    RollingKVCacheEngine,
    StaticKVCacheEngine,
    VanillaKVCacheEngine,
)
from .masks import CausalMask, block_causal_mask, chunk_schedule, teacher_forcing_mask
from .model import clear_caches, uninstall_causal_kv
from .modular import (
    causal_wan22_blocks,
    causal_wan22_i2v_blocks,
    causal_wan22_vace_blocks,
    causal_wan_blocks,
    causal_wan_i2v_blocks,
)
from .parallel import CFGAcrossRanks, causal_cp_plan
from .pipelines import CausalWanPipeline
from .planner import RolloutPlanner
from .processors import CausalWanAttnProcessor
from .refill import prefill, recache, reset_conditioning
from .rolling_forcing import RollingForcingSession, make_session
from .rollout import RolloutOutput, causal_rollout, self_forcing_rollout
from .session import RolloutSession, Sampling
from .streaming import StreamingRollout
from .streaming_vae import StreamingVAEDecoder, StreamingVAEEncoder

__all__ = [
    "BaseKVCacheEngine",
    "CFGAcrossRanks",
    "CausalConfig",
    "CausalContext",
    "CausalMask",
    "CausalWanAttnProcessor",
    "CausalWanPipeline",
    "KVCacheEngine",
    "RollingForcingSession",
    "RollingKVCacheEngine",
    "RolloutOutput",
    "RolloutPlanner",
    "StaticKVCacheEngine",
    "RolloutSession",
    "Sampling",
    "StreamingRollout",
    "StreamingVAEDecoder",
    "StreamingVAEEncoder",
    "VanillaKVCacheEngine",
    "block_causal_mask",
    "causal_cp_plan",
    "causal_wan22_blocks",
    "causal_wan22_i2v_blocks",
    "causal_wan22_vace_blocks",
    "causal_wan_blocks",
    "causal_wan_i2v_blocks",
    "causal_rollout",
    "chunk_schedule",
    "clear_caches",
    "get_current_context",
    "make_session",
    "prefill",
    "recache",
    "reset_conditioning",
    "self_forcing_rollout",
    "teacher_forcing_mask",
    "uninstall_causal_kv",
]
