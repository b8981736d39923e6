"""Serving many viewers: live streams batched into one forward (:func:`step_streams`)."""

from .batching import step_streams

__all__ = ["step_streams"]
