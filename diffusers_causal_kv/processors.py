"""``CausalWanAttnProcessor``: the attention processor that makes a stock Wan transformer causal.

Install it with ``transformer.set_attn_processor(CausalWanAttnProcessor())`` (one instance may serve every module,
or pass the dict form). Outside a :class:`~diffusers_causal_kv.CausalContext` it runs the stock
``WanAttnProcessor`` code, so outputs are bitwise identical. Inside one, it asks the running pass which engine
registered the module (never a hardcoded branch) and then:

* self-attention (``attn1``): hands the chunk's key/value and rotary tables to the engine in one call
  (:meth:`~diffusers_causal_kv.BaseKVCacheEngine.update`), attends over what it returns (the cached prefix
  followed by the chunk), and, in a ``store_kv=True`` forward, stages the chunk's K/V as the engine stores them;
* cross-attention (``attn2``): in no-grad forwards reads the tag's cross entry when it is filled and skips the K/V
  projections; otherwise projects the conditioning (text, plus Wan2.1 I2V image tokens) and, in a
  ``store_kv=True`` forward, stages it for the commit;
* a batch of several tags (``CausalContext(cache_tag=("pos", "neg"))``): projects the whole batch at once and
  attends each tag's rows over that tag's cache (and cross entry), as above.

In the mask modes (``CausalContext(..., mode="block_causal" | "teacher_forcing")``) the forward is a whole
sequence: self-attention applies the pass's :class:`~diffusers_causal_kv.CausalMask` (a ``BlockMask`` for the flex
backend, a dense boolean mask otherwise), cross-attention always projects, and no engine is touched.

Attention itself goes through ``dispatch_attention_fn`` with this processor's ``_attention_backend``, so
``transformer.set_attention_backend(...)`` applies, and, for self-attention, its ``_parallel_config``, so that under
``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N), cp_plan=causal_cp_plan(transformer))``
diffusers' Ulysses path attends a rank's queries over every rank's cached and current keys (cross-attention K/V are
replicated, so each rank attends its own queries alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    dispatch_attention_fn,
)
from diffusers.models.transformers.transformer_wan import (
    WanAttnProcessor,
    _get_added_kv_projections,
    _get_qkv_projections,
)

from .ambient import running_pass
from .kv_cache import BaseKVCacheEngine, CrossEntry, PassInfo
from .masks import CausalMask
from .rotary import ChunkRotary, apply_rotary_emb

# The stock Wan processor hardcodes the text encoder's context length when splitting I2V image tokens off.
WAN_TEXT_CONTEXT_LENGTH = 512
# Backends that take a FlexAttention BlockMask; every other backend gets the dense boolean mask.
_FLEX = {AttentionBackendName.FLEX}


class AttentionPass(Protocol):
    """What the processors read of the forward pass they serve (the model layer's ``ForwardPass`` is one); nothing
    else of it."""

    info: PassInfo | None
    """Cache mode: what the engines know of the pass (``None`` in mask modes and for a batch of tags)."""
    mask: CausalMask | None
    """Mask modes (training): the attention mask of the whole sequence."""
    temporal_rope: tuple[torch.Tensor, torch.Tensor] | None
    """The model's temporal RoPE rows, for engines that number window frames at read time (set by the RoPE hook,
    which runs before any attention of the forward)."""
    tag_passes: Sequence[AttentionPass] | None
    """A batch of tags: the pass of each tag's rows, in batch order."""

    @property
    def stages(self) -> bool:
        """Whether to stage this pass's K/V for its commit."""

    def engine_for(self, attn: torch.nn.Module) -> BaseKVCacheEngine:
        """The engine that owns ``attn``."""

    def memo_for(self, engine: BaseKVCacheEngine) -> dict:
        """The prefixes a grad-enabled pass read from ``engine`` (for a checkpoint recomputation)."""

    def stage_self(self, engine: BaseKVCacheEngine, block_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep a block's self K/V for the commit."""

    def stage_cross(self, engine: BaseKVCacheEngine, block_idx: int, entry: CrossEntry) -> None:
        """Keep a block's cross K/V for the tag's first commit."""


class CausalWanAttnProcessor:
    """Causal, KV-cached attention for ``WanAttention`` (self and cross; Wan T2V, Wan2.1 I2V, Wan2.2, VACE)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        p: AttentionPass | None = running_pass()
        if p is None:
            # Run the stock processor's code with this processor's backend settings: bitwise stock outputs.
            return WanAttnProcessor.__call__(
                self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        if encoder_hidden_states is not None:
            out = _by_tag(p, lambda part, h, e: self._attend_context(attn, h, self._context_kv(attn, part, e)),
                          hidden_states, encoder_hidden_states)
        else:
            query, key, value = _get_qkv_projections(attn, hidden_states, None)
            query, key, value = _heads(attn, attn.norm_q(query), attn.norm_k(key), value)
            if p.mask is None:
                out = _by_tag(p, lambda part, q, k, v: self._attend_cached(attn, part, q, k, v, rotary_emb),
                              query, key, value)
            else:  # a mask mode: the whole sequence at once, no cache
                query, key = apply_rotary_emb(query, *rotary_emb), apply_rotary_emb(key, *rotary_emb)
                out = self._attend(query, key, value, self._dispatchable(p.mask, query.device))
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    def _attend_cached(self, attn, p: AttentionPass, query, key, value, rotary_emb) -> torch.Tensor:
        engine = p.engine_for(attn)
        block_idx = engine.block_index(attn)
        rotary = None if rotary_emb is None else ChunkRotary(*rotary_emb, *p.temporal_rope)
        kv = engine.update(block_idx, p.info, key, value, rotary, p.memo_for(engine))
        if p.stages:
            p.stage_self(engine, block_idx, kv.commit_key, kv.commit_value)
        # Under context parallelism the query holds this rank's rows of the chunk, the keys and values its rows of
        # the prefix and the chunk: diffusers' Ulysses path attends each head over every rank's keys.
        return self._attend(query if rotary is None else rotary.apply(query), kv.key, kv.value,
                            parallel_config=self._parallel_config)

    def _context_kv(self, attn, p: AttentionPass, encoder_hidden_states) -> CrossEntry:
        """The conditioning's K/V: the cached entry in no-grad cached passes once filled, else projected (and
        staged by the first ``store_kv=True`` forward of a tag). Mask modes always project."""
        if p.mask is not None:
            return _project_context(attn, encoder_hidden_states)
        engine = p.engine_for(attn)
        block_idx = engine.block_index(attn)
        entry = None if p.info.grad_enabled else engine.read_cross(block_idx, p.info.cache_tag)
        if entry is None:
            entry = _project_context(attn, encoder_hidden_states)
            if p.stages and not engine.is_cross_init(p.info.cache_tag):
                p.stage_cross(engine, block_idx, entry)
        return entry

    def _attend_context(self, attn, hidden_states, entry: CrossEntry) -> torch.Tensor:
        query = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))[0]
        out = self._attend(query, entry.key, entry.value)
        if entry.key_img is not None:
            out = out + self._attend(query, entry.key_img, entry.value_img)
        return out

    def _dispatchable(self, mask, device):
        """FlexAttention takes the mask as a ``BlockMask``; every other backend as a dense boolean tensor."""
        # Without a backend of its own, dispatch_attention_fn uses the globally active one.
        backend = self._attention_backend or _AttentionBackendRegistry.get_active_backend()[0]
        return mask.block_mask(device) if AttentionBackendName(backend) in _FLEX else mask.dense(device)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None,
                parallel_config=None) -> torch.Tensor:
        out = dispatch_attention_fn(
            query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend,
            parallel_config=parallel_config,
        )
        return out.flatten(2, 3).type_as(query)


def _by_tag(p: AttentionPass, attend, *tensors: torch.Tensor) -> torch.Tensor:
    """``attend(p, *tensors)``; for a batch of tags, ``attend`` on each tag's rows with that tag's pass, joined in
    batch order (the projections around it run once over the whole batch)."""
    if p.tag_passes is None:
        return attend(p, *tensors)
    rows = tensors[0].shape[0] // len(p.tag_passes)
    return torch.cat([attend(part, *(t[i * rows:(i + 1) * rows] for t in tensors))
                      for i, part in enumerate(p.tag_passes)])


def _heads(attn: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.unflatten(2, (attn.heads, -1)) for t in tensors)


def _project_context(attn: torch.nn.Module, encoder_hidden_states: torch.Tensor) -> CrossEntry:
    """Cross-attention K/V of the conditioning, split into text and (Wan2.1 I2V) image tokens as stock does."""
    image_states = None
    if attn.add_k_proj is not None:
        image_length = encoder_hidden_states.shape[1] - WAN_TEXT_CONTEXT_LENGTH
        image_states = encoder_hidden_states[:, :image_length]
        encoder_hidden_states = encoder_hidden_states[:, image_length:]
    if attn.fused_projections:
        key, value = attn.to_kv(encoder_hidden_states).chunk(2, dim=-1)
    else:
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
    key, value = _heads(attn, attn.norm_k(key), value)
    if image_states is None:
        return CrossEntry(key, value)
    key_img, value_img = _get_added_kv_projections(attn, image_states)
    key_img, value_img = _heads(attn, attn.norm_added_k(key_img), value_img)
    return CrossEntry(key, value, key_img, value_img)
