"""The published causal Wan checkpoints the converter knows: how each is laid out and how its authors sample it.

Every fact below was read in the peer's own code (repository and path in the comment above its entry; where the
upstream repository was not available to read, a fork that keeps the file unchanged was read and is named). Each
entry says how the weights are wrapped (``layout``), which of the wrapper's entries the peer's inference loads by
default (``ema``), and the :class:`~diffusers_causal_kv.CausalConfig` its inference script and config use.

Two layouts exist:

* ``"wrapper"``: a ``torch.save`` of ``{"generator": ..., "generator_ema": ..., "critic": ...}`` (CausVid has no
  EMA; CausVid's I2V and ODE checkpoints use ``"model"``), each the FSDP full state dict of the peer's
  ``WanDiffusionWrapper``, so every key is ``model.<original Wan key>``;
* ``"flat"``: one state dict in the original Wan key layout, in safetensors (possibly sharded, with an index json),
  possibly under ``model.`` (Krea ships its wrapper's state dict).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..causal_config import CausalConfig

WRAPPER, FLAT = "wrapper", "flat"


@dataclass(frozen=True)
class PeerFormat:
    """One ``--format`` of the converter."""

    name: str
    title: str
    layout: str
    """``"wrapper"`` or ``"flat"`` (see the module docstring)."""
    ema: bool
    """Whether the peer's documented inference command loads ``generator_ema`` (else ``generator``)."""
    sampling: CausalConfig
    hints: tuple[str, ...] = ()
    """Lower-case fragments of the released file's path that identify the peer under ``format="auto"``."""


SELF_FORCING_STEPS = (1000.0, 750.0, 500.0, 250.0)

FORMATS: dict[str, PeerFormat] = {
    # guandeh17/Self-Forcing: README.md runs `inference.py --config_path configs/self_forcing_dmd.yaml
    # --checkpoint_path checkpoints/self_forcing_dmd.pt --use_ema`; inference.py loads
    # state_dict['generator' if not args.use_ema else 'generator_ema'] into the WanDiffusionWrapper (keys
    # `model.*`, trainer/distillation.py saves FSDP full state dicts). configs/self_forcing_dmd.yaml (read in the fork
    # junbao-zhou/Self-Forcing): denoising_step_list [1000, 750, 500, 250], warp_denoising_step true, timestep_shift
    # 5.0, num_frame_per_block 3; configs/default_config.yaml: context_noise 0. pipeline/causal_inference.py warps
    # the steps (`timesteps[1000 - t]` of the shift-5 scheduler), commits each chunk with timestep `context_noise`
    # and no re-noising, attends globally (local_attn_size -1), no guidance; inference.py draws 21 latent frames.
    "self_forcing": PeerFormat(
        "self_forcing", "Self-Forcing", WRAPPER, ema=True,
        sampling=CausalConfig(chunk_frames=3, timesteps=SELF_FORCING_STEPS, shift=5.0, context_noise=0.0,
                              guidance_scale=1.0, num_frames=81, source="self_forcing"),
        hints=("self_forcing", "self-forcing"),
    ),
    # thu-ml/Causal-Forcing: README.md downloads zhuhz22/Causal-Forcing chunkwise/causal_forcing.pt and runs the
    # chunk-wise model without --use_ema (the frame-wise ones with it); its inference is Self-Forcing's.
    # configs/causal_forcing_dmd_chunkwise.yaml (read in the forks AshadowZ/PackForcing-Unofficial and
    # zhuobaidong/Glance-Forcing): Self-Forcing's steps, warp and shift, num_frame_per_block 3. The frame-wise
    # checkpoints need chunk_frames=1 and ema=True.
    "causal_forcing": PeerFormat(
        "causal_forcing", "Causal-Forcing (chunk-wise)", WRAPPER, ema=False,
        sampling=CausalConfig(chunk_frames=3, timesteps=SELF_FORCING_STEPS, shift=5.0, context_noise=0.0,
                              guidance_scale=1.0, num_frames=81, source="causal_forcing"),
        hints=("causal_forcing", "causal-forcing"),
    ),
    # tianweiy/CausVid (read in the fork yitongdeng2/CausVid): README.md points at the Hugging Face repo
    # tianweiy/CausVid, folder autoregressive_checkpoint; minimal_inference/autoregressive_inference.py loads
    # model.pt['generator'] (the trainer saves no EMA). configs/wan_causal_dmd.yaml: denoising_step_list
    # [1000, 757, 522, 0], num_frame_per_block 3, no warp. causvid/models/wan/causal_inference.py drops the final 0
    # and uses the others as timestep labels directly; its scheduler's table maps label t to sigma t / 1000, hence
    # shift 1 here. Chunks are committed at timestep 0 (`timestep * 0`).
    "causvid": PeerFormat(
        "causvid", "CausVid", WRAPPER, ema=False,
        sampling=CausalConfig(chunk_frames=3, timesteps=(1000.0, 757.0, 522.0), shift=1.0, context_noise=0.0,
                              guidance_scale=1.0, num_frames=81, source="causvid"),
        hints=("causvid", "autoregressive_checkpoint"),
    ),
    # NVlabs/LongLive v1.0 (read in the fork ywlq/LongLive): inference.py loads longlive_base.pt['generator']
    # (use_ema: false), wraps generator.model with PEFT (utils/lora_utils.py: every nn.Linear inside a
    # CausalWanAttentionBlock) and loads lora.pt['generator_lora'] with peft.set_peft_model_state_dict.
    # configs/longlive_inference.yaml: steps [1000, 750, 500, 250] warped, timestep_shift 5.0, num_frame_per_block
    # 3 (the current NVlabs main branch says 6), local_attn_size 12 and sink_size 3 (latent frames; the window
    # counts the current chunk, wan/modules/causal_model.py), context_noise 0, num_output_frames 120, adapter rank
    # 256, alpha 256. pipeline/causal_inference.py commits with the `context_noise` label like Self-Forcing.
    "longlive": PeerFormat(
        "longlive", "LongLive", WRAPPER, ema=False,
        sampling=CausalConfig(chunk_frames=3, timesteps=SELF_FORCING_STEPS, shift=5.0, context_noise=0.0,
                              guidance_scale=1.0, num_frames=477, window_frames=12, sink_frames=3,
                              source="longlive"),
        hints=("longlive",),
    ),
    # krea-ai/realtime-video: release_server.py loads the safetensors with load_file() into WanDiffusionWrapper
    # (keys `model.*`, original Wan names), 14B; GenerateParams: num_denoising_steps 6 ("use 4 for performance"),
    # kv_cache_num_frames 3, num_blocks 9, context_noise 0; v2v.py get_denoising_schedule: linspace(1000, 0, steps)
    # warped like Self-Forcing (configs/self_forcing_server_14b.yaml: timestep_shift 5.0, num_frame_per_block 3).
    # The last step is labelled 0, which the shift-5 scheduler snaps to its smallest entry, t = 1. Krea recomputes
    # the K/V of its context every chunk (first latent frame plus the 2 latest, at relative positions): a window of
    # 3 + 3 frames with a 1-frame sink is the closest CausalConfig.
    "krea": PeerFormat(
        "krea", "Krea Realtime 14B", FLAT, ema=False,
        sampling=CausalConfig(chunk_frames=3, timesteps=(1000.0, 800.0, 600.0, 400.0, 200.0, 1.0), shift=5.0,
                              context_noise=0.0, guidance_scale=1.0, num_frames=105, window_frames=6,
                              sink_frames=1, positions="relative", source="krea"),
        hints=("krea",),
    ),
    # Any original-layout Wan transformer (the official Wan2.1 releases: diffusion_pytorch_model*.safetensors with
    # an index json). It was not trained causally: the sampling settings are CausalConfig's defaults.
    "wan": PeerFormat("wan", "original Wan layout", FLAT, ema=False, sampling=CausalConfig(source="wan")),
}

FORMAT_NAMES = ("auto", *FORMATS)
