"""Serving many viewers: live streams batched into one forward (:func:`step_streams`); the stream server
(``python -m diffusers_causal_kv.serve``, :mod:`.server`) and its Ray Serve deployment (:mod:`.ray_deployment`), which
need the ``serve`` / ``ray`` extras and are imported only from their own modules."""

from .batching import step_streams

__all__ = ["step_streams"]
