"""The random numbers of one rollout: one ``torch.Generator`` for the whole batch, or one per sample.

diffusers' pipelines take ``generator=[g0, g1, ...]`` to give every sample of a batch its own noise, so that sample
``i`` of a batched call equals a single call with ``g_i``. :class:`NoiseSource` keeps that promise for every draw a
causal rollout makes (each chunk's initial noise and every re-noising), and can save and restore its state so that a
chunk whose forward raised is retried with the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor


class NoiseSource:
    """Draws the noise of a rollout.

    Args:
        generator: ``None`` (torch's global generator), one ``torch.Generator`` for the whole batch, or a list of
            them, one per sample (sample ``i``'s noise comes from ``generator[i]`` alone).
    """

    def __init__(self, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> None:
        if isinstance(generator, NoiseSource):
            generator = generator.generator
        if isinstance(generator, (list, tuple)):
            if not generator or not all(isinstance(g, torch.Generator) for g in generator):
                raise TypeError("generator must be a torch.Generator or a non-empty list of them (one per sample).")
            generator = list(generator)
        elif generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or a list of them, got {type(generator).__name__}.")
        self.generator = generator

    @property
    def per_sample(self) -> bool:
        return isinstance(self.generator, list)

    def check_batch(self, batch: int) -> None:
        """Refuse a list of generators whose length is not the batch size, before any work."""
        if self.per_sample and len(self.generator) != batch:
            raise ValueError(f"generator is a list of {len(self.generator)} generators but the batch has {batch} "
                             f"samples; pass one generator per sample ({batch}) or a single generator.")

    def initial(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """A chunk's initial noise (fp32), drawn as the stock pipelines draw latents (``randn_tensor``)."""
        return randn_tensor(tuple(shape), generator=self.generator, device=device, dtype=torch.float32)

    def like(self, x: torch.Tensor) -> torch.Tensor:
        """Fresh noise of ``x``'s shape, dtype and device (the re-noising between few-step steps and of commits)."""
        self.check_batch(x.shape[0])
        # randn_tensor draws on a generator's own device (a CPU generator for CUDA latents, as diffusers allows)
        return randn_tensor(tuple(x.shape), generator=self.generator, device=x.device, dtype=x.dtype)

    def state(self) -> list[torch.Tensor]:
        """The generators' states (torch's global CPU generator when none was given), for :meth:`restore`."""
        if self.generator is None:  # the global generators: CPU, and every CUDA device torch has set up
            return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])]
        return [g.get_state() for g in (self.generator if self.per_sample else [self.generator])]

    def restore(self, states: list[torch.Tensor]) -> None:
        if self.generator is None:
            torch.set_rng_state(states[0])
            if len(states) > 1:
                torch.cuda.set_rng_state_all(states[1:])
            return
        for g, s in zip(self.generator if self.per_sample else [self.generator], states):
            g.set_state(s)
