"""The context layer: one forward pass's rollout metadata, published per transformer.

A :class:`CausalContext` is opened around transformer forwards. Opening it completes installation (the model
layer's ``prepare_transformer``) and publishes it in :mod:`~diffusers_causal_kv.ambient`, keyed by the transformer,
so contexts for different transformers nest freely and each thread and asyncio task sees its own. The model-layer
hook reads it at the start of each forward; nothing below the model layer ever sees it.
"""

from __future__ import annotations

import torch

from .ambient import close_context, current_context, open_context
from .kv_cache import BaseKVCacheEngine, owning_engine
from .masks import CausalMask
from .model import prepare_transformer

MODES = ("cache", "block_causal", "teacher_forcing")


class CausalContext:
    """Run forwards of ``transformer`` causally against its KV cache.

    Args:
        transformer: the Wan transformer the context applies to; forwards of other transformers are unaffected.
        start_frame (int): latent frame at which this forward's chunk starts. It gives the chunk's temporal RoPE
            positions (``start_frame, start_frame + 1, ...``) and must continue the tag's cache: it equals the
            engine's ``next_frame(cache_tag)`` (for append-only engines, the number of cached frames), on
            denoising and commit passes alike.
        cache_tag (str | tuple[str, ...]): namespace of the cache entries read and written, e.g. ``"pos"``/``"neg"``
            for CFG. A tuple of distinct tags runs a batch of several tags in one forward (the rollout planner's
            batched guidance): the batch splits into ``len(cache_tag)`` equal groups of rows, in order, and each group
            reads and commits its own tag, as separate forwards on each tag would. ``cache_tags`` holds the tags as
            a tuple either way.
        store_kv (bool): when True, the forward's self K/V (and, the first time, the cross-attention K/V) are
            committed to the cache once the forward returns. A forward that raises commits nothing.
        cache_engines (dict[str, BaseKVCacheEngine]): the engines read and written, one per branch (``"main"``,
            plus ``"vace"`` for VACE). Defaults to ``transformer.kv_cache_engines``; pass your own map to run one
            rollout per user session over one set of weights. Resolved and registered when the context opens.
        mode (str): how self-attention sees other frames.

            * ``"cache"`` (default): the forward is one chunk of a rollout; it attends over the engine's cached
              prefix and itself (inference, self-forcing).
            * ``"block_causal"``: the forward is a whole sequence, self-attention is masked with
              :func:`~diffusers_causal_kv.block_causal_mask` and no cache is read or written (diffusion forcing /
              causal pretraining, with per-chunk noise levels passed as per-token timesteps).
            * ``"teacher_forcing"``: the forward is ``[clean context | noisy frames]`` (two halves of the same length
              and chunk schedule), masked with :func:`~diffusers_causal_kv.teacher_forcing_mask`; both halves get the
              same temporal RoPE positions, ``start_frame ...``, so noisy chunk *k* sits at clean chunk *k*'s
              positions. No cache is involved.
        chunk_frames (int | list[int]): mask modes: the chunk schedule (of one half, for teacher forcing), with the
            remainder rule of :func:`~diffusers_causal_kv.chunk_schedule`. The mask is built for each forward.
        window_frames (int | None): mask modes: restrict each chunk to a sliding window of ``window_frames``
            frames plus the first ``sink_frames`` frames (see :mod:`diffusers_causal_kv.masks`).
        sink_frames (int): mask modes: the first frames every chunk attends to, besides its window.
        mask (CausalMask): mask modes: a prebuilt mask instead of ``chunk_frames``/``window_frames``/
            ``sink_frames`` (reuse one across training steps; a FlexAttention ``BlockMask`` is built once). Its
            ``kind`` must be the mode and its size the forward's sequence.

    The context is a re-usable, non-reentrant context manager. Opening it completes installation (engine
    creation, module registration, hooks) if ``transformer.set_attn_processor(CausalWanAttnProcessor())`` was
    called but no context has been opened yet.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        *,
        start_frame: int = 0,
        cache_tag: str = "pos",
        store_kv: bool = False,
        cache_engines: dict[str, BaseKVCacheEngine] | None = None,
        mode: str = "cache",
        chunk_frames: int | list[int] | None = None,
        window_frames: int | None = None,
        sink_frames: int = 0,
        mask: CausalMask | None = None,
    ) -> None:
        if isinstance(start_frame, bool) or not isinstance(start_frame, int):
            raise TypeError(f"start_frame must be an int (a latent frame index), got {type(start_frame).__name__}.")
        if start_frame < 0:
            raise ValueError(f"start_frame must be >= 0, got {start_frame}; pass the latent frame the chunk starts at.")
        tags = cache_tag if isinstance(cache_tag, tuple) and cache_tag else (cache_tag,)
        for tag in tags:
            if not isinstance(tag, str):
                raise TypeError(f"cache_tag must be a str such as 'pos' or 'neg' (or a tuple of them), got "
                                f"{type(tag).__name__}.")
        if len(set(tags)) != len(tags):
            raise ValueError(f"cache_tag={cache_tag!r} names a tag twice; a batch of tags gives each tag one group of "
                             "rows, so name each tag once.")
        _check_mode(mode, store_kv, chunk_frames, window_frames, sink_frames, mask)
        self.transformer = transformer
        self.start_frame = start_frame
        self.cache_tag = cache_tag
        self.cache_tags = tags
        self.store_kv = bool(store_kv)
        self._requested_engines = cache_engines
        self.mode = mode
        self.chunk_frames = chunk_frames
        self.window_frames = window_frames
        self.sink_frames = sink_frames
        self.mask = mask
        self.cache_engines: dict[str, BaseKVCacheEngine] | None = None
        self._token = None

    def __enter__(self) -> CausalContext:
        if self._token is not None:
            raise RuntimeError("This CausalContext is already open; create a new CausalContext to nest one.")
        self.cache_engines = prepare_transformer(self.transformer, self._requested_engines)
        self._token = open_context(self.transformer, self)
        return self

    def __exit__(self, *exc_info) -> None:
        close_context(self._token)
        self._token = None

    def resolve_registered_engine(self, attn: torch.nn.Module) -> BaseKVCacheEngine:
        """The engine of this context that registered ``attn``; raises if none did."""
        if self.cache_engines is None:
            raise RuntimeError(
                "resolve_registered_engine() needs an open context: use it inside `with CausalContext(...)`."
            )
        return owning_engine(self.cache_engines, attn)

    def __repr__(self) -> str:
        return (
            f"CausalContext({type(self.transformer).__name__}, start_frame={self.start_frame}, "
            f"cache_tag={self.cache_tag!r}, store_kv={self.store_kv}, mode={self.mode!r})"
        )


def _check_mode(mode, store_kv, chunk_frames, window_frames, sink_frames, mask) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    mask_options = {"chunk_frames": chunk_frames, "window_frames": window_frames, "sink_frames": sink_frames or None,
                    "mask": mask}
    if mode == "cache":
        given = [name for name, value in mask_options.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply to the mask modes 'block_causal' and 'teacher_forcing'; in "
                "mode='cache' the engine decides what a chunk attends to (use a rolling engine for a window)."
            )
        return
    if store_kv:
        raise ValueError(
            f"mode={mode!r} runs the whole sequence with a mask and never touches the KV cache, so store_kv=True "
            "cannot apply; commit chunks with mode='cache' (the default)."
        )
    if (mask is None) == (chunk_frames is None):
        raise ValueError(
            f"mode={mode!r} needs exactly one of chunk_frames (the mask is built per forward) or mask (a prebuilt "
            "CausalMask)."
        )
    if mask is not None:
        if window_frames is not None or sink_frames:
            raise ValueError("window_frames/sink_frames are part of a prebuilt mask; pass them to its builder.")
        if getattr(mask, "kind", None) != mode:
            raise ValueError(
                f"mask is {mask!r} but mode={mode!r}; build it with the {mode}_mask() builder or change the mode."
            )


def get_current_context(transformer: torch.nn.Module) -> CausalContext | None:
    """The innermost open :class:`CausalContext` of ``transformer`` in this thread/task, or ``None``."""
    return current_context(transformer)
