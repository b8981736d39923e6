"""The published causal Wan checkpoints the converter knows: how each is laid out and how its authors sample it.

Every fact below was read in the peer's own code (repository and path in the comment above its entry; where the
upstream repository was not available to read, a fork that keeps the file unchanged was read and is named). Each
entry says how the weights are wrapped (``layout``), which of the wrapper's entries the peer's inference loads by
default (``ema``), and the :class:`~diffusers_causal_kv.CausalConfig` its inference script and config use.

Three layouts exist:

* ``"wrapper"``: a ``torch.save`` of ``{"generator": ..., "generator_ema": ..., "critic": ...}`` (CausVid has no
  EMA; CausVid's I2V and ODE checkpoints use ``"model"``), each the FSDP full state dict of the peer's
  ``WanDiffusionWrapper``, so every key is ``model.<original Wan key>``;
* ``"flat"``: one state dict in the original Wan key layout, in safetensors (possibly sharded, with an index json),
  possibly under ``model.`` (Krea ships its wrapper's state dict);
* ``"experts"``: the two experts of a Wan2.2 A14B model in one folder (:mod:`.experts`), each a flat state dict in
  the original or the diffusers naming, or a LoRA of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..causal_config import CausalConfig

WRAPPER, FLAT, EXPERTS = "wrapper", "flat", "experts"


@dataclass(frozen=True)
class PeerFormat:
    """One ``--format`` of the converter."""

    name: str
    title: str
    layout: str
    """``"wrapper"``, ``"flat"`` or ``"experts"`` (see the module docstring)."""
    ema: bool
    """Whether the peer's documented inference command loads ``generator_ema`` (else ``generator``)."""
    sampling: CausalConfig
    hints: tuple[str, ...] = ()
    """Lower-case fragments of the released file's path that identify the peer under ``format="auto"``."""


SELF_FORCING_STEPS = (1000.0, 750.0, 500.0, 250.0)
ROLLING_FORCING_STEPS = (1000.0, 800.0, 600.0, 400.0, 200.0)

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
    # NVlabs/LongLive 2.0 (main branch; its docs LongLive2/docs/index.html and README.md read upstream, the configs
    # and pipeline read in the forks zonghui-liu-opt/LongLive_cats, yyang181/LongLive and fork-the-planet/
    # NVlabs___LongLive): Wan2.2-TI2V-5B (wan_5b/modules/causal_model.py keeps Wan's module names, no image
    # embedder). The README's quick start loads Efficient-Large-Model/LongLive-2.0-5B model_bf16.pt, a merged BF16
    # checkpoint, with utils/inference_utils.py load_generator_checkpoint: entry 'generator' (use_ema false) of a
    # torch.save, loaded into the WanDiffusionWrapper (keys `model.*`; a third-party audit script reads
    # state['generator']['model.blocks.0.self_attn.q.weight']). configs/inference.yaml: timestep_shift 5.0,
    # num_frame_per_block 8, local_attn_size 32 (the KV cache holds 32 latent frames, the current chunk included),
    # sink_size 8 with multi_shot_sink (the first 8 frames stay), sampling_steps 4, guidance_scale 1.0, latents
    # [128, 48, 44, 80] (128 latent frames = 509 video frames at 704x1280, 24 fps), commits at timestep 0.
    # Its pipeline/causal_diffusion_inference.py samples each chunk with a 4-step UniPC solver at shift 5; its DMD
    # training rolls out 4 few-step x0 predictions at the same noise levels (linspace(1, 0, 5)[:-1] shifted by 5,
    # i.e. these warped timesteps), which is what CausalConfig can state. Base + LoRA exports: rank 128, alpha 128.
    "longlive2": PeerFormat(
        "longlive2", "LongLive 2.0 (Wan2.2-TI2V-5B)", WRAPPER, ema=False,
        sampling=CausalConfig(chunk_frames=8, timesteps=SELF_FORCING_STEPS, shift=5.0, context_noise=0.0,
                              guidance_scale=1.0, num_frames=509, window_frames=32, sink_frames=8,
                              source="longlive2"),
        hints=("longlive-2", "longlive2", "longlive_2"),
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
    # hao-ai-lab/FastVideo: the Hugging Face repo FastVideo/CausalWan2.2-I2V-A14B-Preview-Diffusers (FastVideo's
    # examples call it FastVideo/SFWan2.2-I2V-A14B-Preview-Diffusers; base model Wan-AI/Wan2.2-I2V-A14B, 57.2 GB:
    # two bf16 experts) is a diffusers pipeline folder: transformer/ (high noise) and transformer_2/ (low noise), in
    # diffusers key names (fastvideo/configs/models/dits/wanvideo.py maps those names onto FastVideo's modules).
    # fastvideo/configs/pipelines/wan.py SelfForcingWan2_2_T2V480PConfig (which FastVideo's registry assigns to
    # this repo): flow_shift 12.0, boundary_ratio 0.875, dmd_denoising_steps [1000, 850, 700, 550, 350, 275, 200,
    # 125], warp_denoising_step true; configs/sample SelfForcingWan2_2_T2V_A14B_480P_SamplingParam: 81 frames at
    # 448x832 (its example: 480x832), 16 fps. fastvideo/pipelines/stages/causal_denoising.py
    # (CausalDMDDenosingStage): chunks of num_frames_per_block (3 by default), the image latent committed first as
    # a chunk of 1 into both experts' caches, each step run by the high-noise expert while the warped timestep is
    # >= 875 (its prediction taken to the boundary's noise level and re-noised from there: pred_noise_to_x_bound,
    # add_noise_high; the low-noise expert's to x0), commits at context_noise 0 into both experts' caches, no
    # classifier-free guidance. The boundary, the first chunk of 1 and the boundary parameterisation are not
    # CausalConfig settings.
    "fastvideo_a14b": PeerFormat(
        "fastvideo_a14b", "FastVideo CausalWan2.2-I2V-A14B (preview)", EXPERTS, ema=False,
        sampling=CausalConfig(chunk_frames=3, timesteps=(1000.0, 850.0, 700.0, 550.0, 350.0, 275.0, 200.0, 125.0),
                              shift=12.0, context_noise=0.0, guidance_scale=1.0, num_frames=81,
                              source="fastvideo_a14b"),
        hints=("causalwan2.2", "causalwan2_2", "sfwan2.2", "sfwan2_2"),
    ),
    # TencentARC/RollingForcing (read in the forks vbsh123/rollingforcing, sk4161/RollingForcing at d8f7bcaf and
    # wenxuansong0506-creator/RollingForcing): README.md downloads TencentARC/RollingForcing
    # checkpoints/rolling_forcing_dmd.pt and runs `inference.py --config_path configs/rolling_forcing_dmd.yaml
    # --num_output_frames 126 --use_ema`; inference.py loads state_dict['generator_ema'] with `_fsdp_wrapped_module.`
    # removed (keys `model.*`). configs/rolling_forcing_dmd.yaml: denoising_step_list [1000, 800, 600, 400, 200],
    # warp_denoising_step true, timestep_shift 5.0, num_frame_per_block 3; configs/default_config.yaml: context_noise
    # 0. pipeline/rolling_forcing_inference.py denoises a window of one chunk per step (the rolling-forcing sampler);
    # its model (wan/modules/causal_model.py, CausalWanSelfAttention) attends over 21 latent frames with the first
    # chunk as a sink re-indexed next to the recent frames (`rope_start_frame`): window 21, sink 3, relative positions.
    # 126 latent frames are 501 video frames.
    "rolling_forcing": PeerFormat(
        "rolling_forcing", "Rolling Forcing", WRAPPER, ema=True,
        sampling=CausalConfig(chunk_frames=3, timesteps=ROLLING_FORCING_STEPS, shift=5.0, context_noise=0.0,
                              guidance_scale=1.0, num_frames=501, window_frames=21, sink_frames=3,
                              positions="relative", sampler="rolling_forcing", source="rolling_forcing"),
        hints=("rolling_forcing", "rolling-forcing", "rollingforcing"),
    ),
    # thu-ml/Causal-Forcing, Causal-Forcing++ (README.md read upstream; configs and pipeline read in the fork
    # kw7243/Causal-Forcing at d53ec74f): README.md downloads zhuhz22/Causal-Forcing
    # causal-forcing++/framewise-2step.pt and framewise-1step.pt and runs them with `--use_ema` and
    # configs/causal_forcing_dmd_framewise_2step.yaml / _1step.yaml: denoising_step_list [1000, 500] / [1000],
    # denoising_step_list_first_chunk [1000, 750, 500, 250], warp_denoising_step true, timestep_shift 5.0,
    # num_frame_per_block 1. pipeline/causal_inference.py denoises block 0 with the first-chunk list, the others with
    # denoising_step_list, commits at context_noise (0), attends globally; inference.py is Self-Forcing's (21 latent
    # frames).
    "causal_forcing_pp_2step": PeerFormat(
        "causal_forcing_pp_2step", "Causal-Forcing++ (frame-wise, 2-step)", WRAPPER, ema=True,
        sampling=CausalConfig(chunk_frames=1, timesteps=(1000.0, 500.0), first_chunk_timesteps=SELF_FORCING_STEPS,
                              shift=5.0, context_noise=0.0, guidance_scale=1.0, num_frames=81,
                              source="causal_forcing_pp_2step"),
        hints=("framewise-2step", "framewise_2step"),
    ),
    "causal_forcing_pp_1step": PeerFormat(
        "causal_forcing_pp_1step", "Causal-Forcing++ (frame-wise, 1-step)", WRAPPER, ema=True,
        sampling=CausalConfig(chunk_frames=1, timesteps=(1000.0,), first_chunk_timesteps=SELF_FORCING_STEPS,
                              shift=5.0, context_noise=0.0, guidance_scale=1.0, num_frames=81,
                              source="causal_forcing_pp_1step"),
        hints=("framewise-1step", "framewise_1step"),
    ),
    # The official Wan2.2 A14B experts (Wan-AI/Wan2.2-I2V-A14B: high_noise_model/ and low_noise_model/ in the
    # original layout; or the -Diffusers repos' transformer/ and transformer_2/). Not trained causally: the sampling
    # settings are CausalConfig's defaults.
    "wan22_a14b": PeerFormat("wan22_a14b", "Wan2.2 A14B experts", EXPERTS, ema=False,
                             sampling=CausalConfig(source="wan22_a14b")),
    # Any original-layout Wan transformer (the official Wan2.1 releases: diffusion_pytorch_model*.safetensors with
    # an index json). It was not trained causally: the sampling settings are CausalConfig's defaults.
    "wan": PeerFormat("wan", "original Wan layout", FLAT, ema=False, sampling=CausalConfig(source="wan")),
}



@dataclass(frozen=True)
class RefusedRelease:
    """A causal release whose weights are a stock Wan transformer but whose inference needs a mechanism the package's
    engines do not have: ``--format NAME`` (or a file ``format="auto"`` recognises by ``hints``) is refused, naming
    the mechanism (``needs``) and what to do instead (``instead``)."""

    name: str
    title: str
    needs: str
    instead: str
    hints: tuple[str, ...] = ()


REFUSED: dict[str, RefusedRelease] = {
    # JaydenLyh/Reward-Forcing (README.md read in YepicAI/Reward-Forcing, configs/reward_forcing.yaml in
    # wangbei1/rlbaseline's copy, wan/modules/causal_model.py in YepicAI/Reward-Forcing): inference.py --use_ema on
    # checkpoints/Reward-Forcing/rewardforcing.pt (Self-Forcing's wrapper layout); chunks of 3, steps [1000, 750, 500,
    # 250] warped at shift 5, local_attn_size 9, sink_size 3. Its self-attention folds every frame the window evicts
    # into the sink (CausalWanSelfAttention.incremental_update, the paper's EMA-Sink), so the sink changes as the video
    # goes on.
    "reward_forcing": RefusedRelease(
        "reward_forcing", "Reward Forcing",
        needs="an EMA sink (the sink K/V updated with an exponential moving average of every frame the window evicts)",
        instead="For its weights alone, convert with format='self_forcing' (--format self_forcing): sampling then uses "
                "a fixed sink (--set window_frames=9 --set sink_frames=3), not Reward Forcing's.",
        hints=("reward_forcing", "reward-forcing", "rewardforcing"),
    ),
    # chenfengxu714/StreamDiffusionV2: streamv2v/inference.py loads <checkpoint_folder>/model.pt['generator'] (CausVid's
    # wrapper layout) and runs causvid/models/wan/causal_stream_inference.py: a batch of chunks, one per denoising
    # step, each with its own copy of the KV cache, written by the denoising forwards of noisy latents (no clean commit
    # pass), with a noise level chosen per chunk from the input video's motion (compute_noise_scale_and_step).
    "streamdiffusionv2": RefusedRelease(
        "streamdiffusionv2", "StreamDiffusionV2",
        needs="a KV cache written by the denoising passes of noisy chunks (one cache copy per pipeline stage, no clean "
              "commit) and a per-chunk noise level taken from the input video's motion",
        instead="For its weights alone, convert <folder>/model.pt with format='causvid' (--format causvid): sampling "
                "then commits clean chunks, as CausVid does.",
        hints=("streamdiffusionv2", "wan_causal_dmd_v2v"),
    ),
    # KlingTeam/MemFlow (its usage notes read in daydreamlive/scope, src/scope/core/pipelines/memflow/docs/usage.md;
    # the checkpoint files themselves were not read): LongLive's training and inference pipeline plus a memory bank
    # of earlier frames' K/V, chosen by relevance to the current prompt, attended to beside the window.
    "memflow": RefusedRelease(
        "memflow", "MemFlow",
        needs="a memory bank of earlier frames' K/V retrieved by relevance to the prompt (narrative adaptive memory)",
        instead="Nothing in the package samples it as trained; LongLive's window and sink (format='longlive') is the "
                "closest mechanism, not an equivalent.",
        hints=("memflow",),
    ),
}

FORMAT_NAMES = ("auto", *FORMATS, *REFUSED)
