"""What a pipeline installs on its transformers: the causal processors, and the engines its causal config describes.

A pipeline's call runs on the transformers' own ``kv_cache_engines`` (unless given ``cache_engines``). Those must be
the engines the pipeline's :class:`~diffusers_causal_kv.CausalConfig` describes, also after ``from_pipe`` gave the
transformer to a pipeline with another config: :func:`install_engines` replaces engines a pipeline made for another
config, and refuses engines the user put there that do not match (naming the fix), before any work.
"""

from __future__ import annotations

import os
import weakref

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from ..causal_config import CausalConfig
from ..kv_cache import BaseKVCacheEngine, KVCacheEngine, RollingKVCacheEngine
from ..model import experts_of, topology
from ..processors import CausalWanAttnProcessor
from ..refill import expert_engines

# Engines a pipeline built from its config (the user's own engines are never replaced).
_MADE_BY_PIPELINE: weakref.WeakSet = weakref.WeakSet()


def install_causal_processors(transformer: torch.nn.Module) -> None:
    """Install ``CausalWanAttnProcessor`` over the stock ``WanAttnProcessor`` of every attention module, keeping each
    module's attention backend (``set_attention_backend``'s choice). Outside a ``CausalContext`` it computes what
    the stock processor computes, so other pipelines sharing the transformer see no change. A transformer that has
    the causal processors is left as it is; processors of another kind are refused rather than overwritten."""
    modules = topology(transformer).attention()
    if has_causal_processors(transformer):
        return  # installed (a partial installation is refused with the model layer's own error)
    foreign = sorted({type(a.processor).__name__ for a in modules if type(a.processor) is not WanAttnProcessor})
    if foreign:
        raise TypeError(
            f"the transformer's attention modules run {', '.join(foreign)}; the causal pipelines install "
            "CausalWanAttnProcessor only over the stock WanAttnProcessor, so as not to drop yours. Call "
            "transformer.set_attn_processor(CausalWanAttnProcessor()) yourself to replace them."
        )
    for attn in modules:
        causal = CausalWanAttnProcessor()
        causal._attention_backend = attn.processor._attention_backend
        attn.set_processor(causal)


def has_causal_processors(transformer: torch.nn.Module) -> bool:
    return any(isinstance(attn.processor, CausalWanAttnProcessor) for attn in topology(transformer).attention())


def takes_condition_latents(transformer) -> bool:
    """Whether the transformer takes I2V condition latents (mask and image latents) beside the noisy ones: Wan2.1
    I2V and Wan2.2 I2V-A14B, told by their input channels (I2V-A14B has no image embeddings to tell it by)."""
    return transformer.config.in_channels != transformer.config.out_channels


def config_engine(config: CausalConfig) -> BaseKVCacheEngine:
    """A new engine of the kind ``config`` describes: rolling with its window, sink and positions, else the
    append-only default."""
    if config.window_frames is None:
        return KVCacheEngine()
    return RollingKVCacheEngine(config.window_frames, config.sink_frames, config.positions)


def install_engines(transformer: torch.nn.Module, config: CausalConfig) -> None:
    """Give ``transformer`` the engines ``config`` describes (see the module docstring) and the causal processors."""
    current = dict(getattr(transformer, "kv_cache_engines", None) or {})
    if not all(_fits(engine, config) for engine in current.values()):
        if not all(engine in _MADE_BY_PIPELINE for engine in current.values()):
            raise ValueError(
                f"transformer.kv_cache_engines holds {_describe(current)}, but the pipeline's causal config describes "
                f"{type(config_engine(config)).__name__} engines (window_frames={config.window_frames}, sink_frames="
                f"{config.sink_frames}, positions={config.positions!r}); pass cache_engines= to the call, set "
                "pipe.causal_config to match the engines, or set transformer.kv_cache_engines = None so the pipeline "
                "builds the config's engines."
            )
        current = {}  # made by a pipeline for another config (from_pipe): replaced
    missing = {branch: config_engine(config) for branch in topology(transformer).branches if branch not in current}
    if missing:
        _MADE_BY_PIPELINE.update(missing.values())
        transformer.kv_cache_engines = {**current, **missing}
    install_causal_processors(transformer)


def _fits(engine: BaseKVCacheEngine, config: CausalConfig) -> bool:
    """Whether ``engine`` is what ``config`` describes. Without a window, any engine the user chose fits (an
    append-only or static one, or a bounded one they set up), but one a pipeline made for a window does not."""
    window = getattr(engine, "window_frames", None)
    if config.window_frames is None:
        return window is None or engine not in _MADE_BY_PIPELINE
    return (window, getattr(engine, "sink_frames", None), getattr(engine, "positions", None)) == (
        config.window_frames, config.sink_frames, config.positions)


def _describe(engines: dict) -> str:
    return ", ".join(f"{branch}: {type(engine).__name__}" + (
        f"(window_frames={engine.window_frames}, sink_frames={engine.sink_frames}, positions={engine.positions!r})"
        if getattr(engine, "window_frames", None) is not None else "") for branch, engine in engines.items())


class LoadingMixin:
    """The loading side of :class:`~diffusers_causal_kv.CausalWanPipeline`: ``causal_config.json`` with the folder,
    the processors and engines on its transformers, the memory their caches hold."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``DiffusionPipeline.from_pretrained``, plus ``causal_config.json`` from a local folder (its root, then its
        ``transformer/``) when ``causal_config`` is not passed."""
        if "causal_config" not in kwargs and os.path.isdir(pretrained_model_name_or_path):
            root = str(pretrained_model_name_or_path)
            kwargs["causal_config"] = CausalConfig.find([root, os.path.join(root, "transformer")])
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_pipe(cls, pipeline, **kwargs):
        """``DiffusionPipeline.from_pipe``: a causal pipeline sharing a loaded pipeline's components; other objects
        are refused with the call that takes them."""
        if isinstance(pipeline, (str, os.PathLike)):
            raise TypeError(
                f"from_pipe takes a loaded pipeline, got the path or hub id {str(pipeline)!r}; load it with "
                "CausalWanPipeline.from_pretrained(...) (or WanPipeline.from_pretrained(...), then from_pipe)."
            )
        if isinstance(pipeline, torch.nn.Module):
            raise TypeError(
                f"from_pipe takes a loaded pipeline, got a {type(pipeline).__name__}; pass a model as a component: "
                "CausalWanPipeline.from_pretrained(folder, transformer=model) or CausalWanPipeline(transformer=model, "
                "vae=..., text_encoder=..., tokenizer=..., scheduler=...)."
            )
        if not hasattr(pipeline, "components"):
            raise TypeError(f"from_pipe takes a loaded pipeline (a DiffusionPipeline), got {type(pipeline).__name__}.")
        return super().from_pipe(pipeline, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``DiffusionPipeline.save_pretrained``, plus the pipeline's ``causal_config.json``."""
        super().save_pretrained(save_directory, *args, **kwargs)
        self.causal_config.save(save_directory)

    def cache_memory_bytes(self, cache_engines: dict | None = None) -> dict[str, int]:
        """Bytes the KV cache holds, per expert: ``{"transformer": n}``, and ``"transformer_2"`` too for a two-expert
        Wan2.2 A14B pipeline (each expert caches the K/V of its own weights, so the cache is held twice).

        ``cache_engines``: the engine map of a call or a stream (a stream's: ``stream.session.planner.cache_engines``
        for one expert); default the transformers' own ``kv_cache_engines``."""
        names = ("transformer", "transformer_2")
        return {name: sum(engine.memory_bytes() for engine in engines.values())
                for name, (_, engines) in zip(names, expert_engines(self, cache_engines))}

    def install_processors(self, cache_engines: dict | None = None) -> None:
        """Install the causal processors on the transformer (and ``transformer_2``); without ``cache_engines``, also
        the engines ``causal_config`` describes (:func:`~diffusers_causal_kv.pipelines.loading.install_engines`):
        engines a pipeline made for another config are replaced, mismatching engines of your own are refused."""
        for transformer in experts_of(self):  # Wan2.2 A14B: both experts, each with its own engines
            if cache_engines is None:
                install_engines(transformer, self.causal_config)
            else:
                install_causal_processors(transformer)
