"""Causal denoise blocks for diffusers' Modular Pipelines (Wan2.1 T2V and I2V; Wan2.2 T2V, I2V and VACE).

The stock ``WanBlocks`` and ``WanImage2VideoAutoBlocks`` (and the Wan2.2 sets ``Wan22Blocks``,
``Wan22Image2VideoBlocks``, ``Wan22VaceBlocks``) denoise the whole video at once: their core denoise step
(``sub_blocks["denoise"]``) sets the scheduler's timesteps once, prepares the latents of every frame and loops over
the timesteps with every frame in each forward. The causal core steps here replace that whole core step. They keep
the stock input steps (prompt batching, I2V condition latents) and the stock ``WanPrepareLatentsStep`` (the noise of
every frame), drop ``WanSetTimestepsStep``, and replace the timestep loop by one block that loops over chunks of
latent frames, runs every denoising step of a chunk against the KV cache of the chunks before it, then commits the
clean chunk to the cache. The stock inner loop (``WanDenoiseLoopWrapper``) cannot be kept: its denoiser runs the
guider's conditional and unconditional batches back to back in one loop step, with no seam to give each its own cache
tag, and the scheduler must be reset for every chunk rather than set once for the video.

The guider's batches map to the cache tags of classifier-free guidance: ``"pred_cond"`` runs on tag ``"pos"`` with
``prompt_embeds``, ``"pred_uncond"`` on tag ``"neg"`` with ``negative_prompt_embeds``; the guider combines their flows
as it does in the stock loop, and its step counter restarts with every chunk (each chunk is a whole denoising
trajectory, so ``start``/``stop`` windows apply per chunk). Every chunk is committed on every tag the guider uses at
any step, so the ``"neg"`` cache stays continuous even where a window skips guidance. Guiders with other batches, or
that change the model for a batch (perturbed-attention, skip-layer, smoothed-energy, auto guidance), are refused: a
perturbed forward would attend to a prefix cached without the perturbation.

Saving: :func:`causal_wan_blocks` turns the stock sets into block sets of their own classes (:class:`CausalWanBlocks`,
:class:`CausalWanImage2VideoAutoBlocks`, :class:`CausalWan22Blocks`, :class:`CausalWan22Image2VideoBlocks`,
:class:`CausalWan22VaceBlocks`), which diffusers loads as custom blocks: a pipeline saved with
``pipe.save_pretrained(folder)`` and ``pipe.blocks.save_pretrained(folder)`` reloads with the causal steps through
``ModularPipeline.from_pretrained(folder, trust_remote_code=True)``.

Wan2.2 (two experts): the denoise step of a Wan2.2 set runs ``transformer`` with ``guider`` at timesteps
``t >= boundary_ratio * 1000`` (the pipeline config's ``boundary_ratio``) and ``transformer_2`` with ``guider_2`` below,
choosing on the timestep passed to the transformer, as the stock ``Wan22LoopDenoiser`` does; every chunk is committed
in both experts' caches (each with its own weights), both or neither. Without a ``transformer_2`` component the one
``transformer`` runs every step with ``guider``. The VACE set's encoder step downsamples the control mask causally
(:func:`~diffusers_causal_kv.pipelines.inputs.causal_vace_mask`, as ``CausalWanPipeline`` does), so a chunk's control
latents depend on its own frames and the ones before only.

The forwards, chunk schedule, pre-flight checks and commits are :class:`~diffusers_causal_kv.RolloutPlanner`'s and the
chunk loop is :class:`~diffusers_causal_kv.RolloutSession`'s, as in :func:`~diffusers_causal_kv.causal_rollout`,
so the blocks give the rollout's latents exactly (random numbers are drawn in the same order).
"""

from .blocks import (
    CausalWan22Blocks,
    CausalWan22CoreDenoiseStep,
    CausalWan22Image2VideoBlocks,
    CausalWan22Image2VideoCoreDenoiseStep,
    CausalWan22VaceBlocks,
    CausalWan22VaceCoreDenoiseStep,
    CausalWanBlocks,
    CausalWanCoreDenoiseStep,
    CausalWanImage2VideoAutoBlocks,
    CausalWanImage2VideoCoreDenoiseStep,
    causal_wan22_blocks,
    causal_wan22_i2v_blocks,
    causal_wan22_vace_blocks,
    causal_wan_blocks,
    causal_wan_i2v_blocks,
)
from .denoise import (
    GUIDER_CACHE_TAGS,
    CausalWan22DenoiseStep,
    CausalWan22Image2VideoDenoiseStep,
    CausalWan22VaceDenoiseStep,
    CausalWanDenoiseStep,
    CausalWanImage2VideoDenoiseStep,
)
from .encoders import CausalWanTextEncoderStep, CausalWanVaceEncoderStep

__all__ = [
    "GUIDER_CACHE_TAGS",
    "CausalWan22Blocks",
    "CausalWan22CoreDenoiseStep",
    "CausalWan22DenoiseStep",
    "CausalWan22Image2VideoBlocks",
    "CausalWan22Image2VideoCoreDenoiseStep",
    "CausalWan22Image2VideoDenoiseStep",
    "CausalWan22VaceBlocks",
    "CausalWan22VaceCoreDenoiseStep",
    "CausalWan22VaceDenoiseStep",
    "CausalWanBlocks",
    "CausalWanCoreDenoiseStep",
    "CausalWanDenoiseStep",
    "CausalWanImage2VideoAutoBlocks",
    "CausalWanImage2VideoCoreDenoiseStep",
    "CausalWanImage2VideoDenoiseStep",
    "CausalWanTextEncoderStep",
    "CausalWanVaceEncoderStep",
    "causal_wan22_blocks",
    "causal_wan22_i2v_blocks",
    "causal_wan22_vace_blocks",
    "causal_wan_blocks",
    "causal_wan_i2v_blocks",
]
