"""``CausalWanPipeline``, split by job: :mod:`.loading` (processors and the engines a config describes),
:mod:`.inputs` (per-task inputs for calls and streams), :mod:`.pipeline` (the class and its call),
:mod:`.open_stream` (setting up a stream) and :mod:`.stream` (the stream iterator)."""

from .loading import install_causal_processors
from .pipeline import CausalWanPipeline
from .stream import CausalWanStream, StreamChunk

__all__ = ["CausalWanPipeline", "CausalWanStream", "StreamChunk", "install_causal_processors"]
