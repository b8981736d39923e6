"""One server: a pipeline, its :class:`~.sessions.SessionLoop` and the app in front (what a Ray Serve replica holds
too), built from :class:`ServerOptions`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from fastapi import FastAPI

from ..pipelines import CausalWanPipeline
from .admission import default_budget
from .app import build_app
from .protocol import Limits, RequestParser
from .sessions import SessionLoop


@dataclass(frozen=True)
class ServerOptions:
    """What a server admits and allows (the command line's options; docs/serving.md lists them)."""

    budget: int | None = None
    """Bytes the sessions' caches may hold together; ``None``: 80% of the device's free memory after loading."""
    max_sessions: int = 8
    token: str | None = None
    batched: bool = True
    idle_timeout: float = 60.0
    max_queued_chunks: int = 2
    height: int = 480
    width: int = 832
    """The size of a session that does not ask for one."""
    limits: Limits = dataclasses.field(default_factory=Limits)


def load_pipeline(model: str, device: str | None = None, dtype: str | None = None) -> CausalWanPipeline:
    """``CausalWanPipeline.from_pretrained(model)`` on ``device`` (default CUDA when there is one) in ``dtype``
    (default bfloat16 on CUDA, float32 elsewhere)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    pipe = CausalWanPipeline.from_pretrained(model, dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def create_server(pipe: CausalWanPipeline, options: ServerOptions, name: str = "local"
                  ) -> tuple[FastAPI, SessionLoop]:
    """The app and its started session loop for ``pipe`` (the loop's thread uses the pipeline from now on; call
    ``loop.shutdown()`` to end it)."""
    patch = pipe.transformer.config.patch_size[1]
    limits = dataclasses.replace(options.limits, size_multiple=pipe.vae_scale_factor_spatial * patch,
                                 temporal=pipe.vae_scale_factor_temporal)
    for name_, size, most in (("height", options.height, limits.max_height),
                              ("width", options.width, limits.max_width)):
        if size > most or size % limits.size_multiple:
            raise ValueError(f"the default {name_} {size} must be a multiple of {limits.size_multiple} and at most "
                             f"the limit {most}; pass another --{name_} or raise --max-{name_}.")
    budget = options.budget or default_budget(pipe._execution_device)
    loop = SessionLoop(pipe, budget, max_sessions=options.max_sessions, batched=options.batched,
                       idle_timeout=options.idle_timeout, name=name)
    app = build_app(loop, RequestParser(limits, (options.height, options.width)), token=options.token,
                    max_queued_chunks=options.max_queued_chunks)
    loop.start()
    return app, loop
