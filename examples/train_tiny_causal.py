"""Train a tiny causal Wan model on synthetic sprite videos, from scratch, on a CPU; write a diffusers pipeline folder.

    python examples/train_tiny_causal.py --output models/tiny-sprites --plot docs/tiny_sprites_loss.png

Three stages, all seeded (``--seed``):

1. **VAE.** A tiny stock ``AutoencoderKLWan`` (4x spatial, no temporal compression, 16 latent channels) learns to
   reconstruct 9-frame sprite clips (``examples/sprites/task.py``): weighted L1 + MSE with the sprite pixels weighted
   up, plus a small KL term. Its ``latents_mean``/``latents_std`` are then set to the statistics of the encoded
   training clips, so the pipeline's un-normalisation gives the transformer unit-scale latents.
2. **Transformer.** A tiny stock ``WanTransformer3DModel`` trained with flow matching on the VAE latents of
   ``--clips`` clips, through the package's training paths: teacher forcing (``CausalContext(mode=
   "teacher_forcing")``: ``[clean | noisy]``, noisy chunk *k* attends to the clean chunks before it and itself, one
   noise level per chunk), which is what a causal rollout with a clean committed prefix sees, and, for a fraction
   ``--bidirectional-fraction`` of the steps, plain full-sequence forwards at one noise level (the stock processors,
   no context: the bidirectional baseline of ``benchmarks/quality.py``). A fraction ``--switch-fraction`` of the
   clips change colour at a chunk boundary, with the prompt naming the new colour and no loss on the chunks before
   the switch: what a prompt switch with a re-cache shows the model. A crop's prompt names the way its sprite moves
   at the crop's start (``Clip.moving_prompt``): after a bounce the clip's own prompt names the opposite one.
   A crop's first chunk is one frame (``--first-chunk-frames 1``, Self-Forcing's independent first frame), the rest
   chunks of 3, and the model samples the same way (``causal_config.json`` lists the chunks): the chunk after the
   first frame sees where the sprite is but not where it goes, so its motion can only come from the prompt's
   direction word. Measured, with chunks of 3 from the start the model ignored that word (3 / 1 / 1 of 8 videos
   started off the prompt's way at seeds 0 / 1 / 2); with the independent first frame, 7 / 6 / 7. Optionally
   (``--frame-noise-fraction``, off by default) the opening frames get their own noise levels (diffusion forcing);
   measured with the independent first frame, it made direction worse (6 / 3 / 5).

The flow-matching losses weight the latent pixels the sprite covers (and their neighbours) ``1 + --sprite-weight``
times: the sprite is ~5% of a frame, and its colour, shape and motion are what the prompt says. A crop's opening (its
first frame and the chunk after it), whose colour, shape and direction no context gives, weighs
``--first-chunk-weight`` times the others.

3. **Self-forcing** (``--self-forcing-steps``). The model continues a real clip's opening on its own with
   ``self_forcing_rollout(context_latents=...)`` (the shipped timesteps, guidance 3, no gradients), then learns the
   clip's real chunks with its own chunks as their context (the teacher-forcing loss, context swapped): the drift of
   its own rollouts (slower, fainter, off the path) is what it is corrected for. Only clips with one prompt are
   rolled out; each step adds one plain teacher-forcing loss, which keeps training the first chunk and the switches.

The prompts are encoded by the pipeline's own text path: the word-level tokenizer and tiny random UMT5 encoder of
``examples/sprites/text.py`` (``--text words``, one token per task word; ``--text chars`` for the package's
character-level ``tiny_tokenizer``), frozen, deterministic per prompt. The folder written by ``--output`` is a
``CausalWanPipeline`` (tokenizer, text encoder, VAE, scheduler, transformer, ``causal_config.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

from diffusers_causal_kv import (
    CausalConfig,
    CausalContext,
    CausalWanAttnProcessor,
    CausalWanPipeline,
    VanillaKVCacheEngine,
    self_forcing_rollout,
)
from diffusers_causal_kv.testing import tiny_text_encoder, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sprites import task  # noqa: E402
from sprites.text import sprite_text_encoder, sprite_tokenizer  # noqa: E402

# The Wan VAE codes the first frame alone, then groups of 4 frames, each group's causal convolutions reading the
# frames before it: 9 frames train a group that follows a group, as every later group of a long video does (with 5,
# frames 5 and later were out of distribution: red sprites decoded blue there).
VAE_CLIP_FRAMES = 9
# Sampling settings saved with the model (its chunks and num_frames from the run's, :func:`sampling_config`): a
# rolling window of 9 frames with re-indexed positions, so a chunk of any long rollout sees at most the positions of
# the last chunk of a 13-frame training crop (``--train-frames``).
SAMPLING = CausalConfig(chunk_frames=3, timesteps=(1000, 750, 500, 250), shift=1.0, guidance_scale=4.0, num_frames=24,
                        window_frames=9, positions="relative")
# Guidance of the self-forcing stage's own rollouts: the shipped weights were trained with 3.0; sampled at 4.0 they
# start off the prompt's way more often (7 / 6 / 7 of 8 at seeds 0 / 1 / 2, against 7 / 6 / 6) and faster.
ROLLOUT_GUIDANCE = 3.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000, help="transformer training steps")
    parser.add_argument("--vae-steps", type=int, default=2000, help="VAE training steps")
    parser.add_argument("--clips", type=int, default=400, help="training clips encoded for the transformer")
    parser.add_argument("--clip-frames", type=int, default=25, help="frames per encoded clip (4k+1)")
    parser.add_argument("--train-frames", type=int, default=13, help="latent frames per training sample")
    parser.add_argument("--chunk-frames", type=int, default=3)
    parser.add_argument("--first-chunk-frames", type=int, default=1,
                        help="latent frames of a crop's (and a rollout's) first chunk; 1: an independent first frame, "
                             "so the chunk after it must take its direction from the prompt")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vae-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100, help="transformer steps of linear learning-rate warmup")
    parser.add_argument("--bidirectional-fraction", type=float, default=0.1)
    parser.add_argument("--text-dropout", type=float, default=0.1,
                        help="fraction of samples trained on the empty prompt (for classifier-free guidance)")
    parser.add_argument("--vae-from", default=None,
                        help="a trained VAE folder (e.g. a previous run's OUTPUT/vae) instead of training one")
    parser.add_argument("--transformer-from", default=None,
                        help="a trained transformer folder (e.g. OUTPUT/transformer) to start from, not a new one")
    parser.add_argument("--switch-fraction", type=float, default=0.2)
    parser.add_argument("--sprite-weight", type=float, default=10.0,
                        help="extra loss weight of the latent pixels the sprite covers (and their neighbours)")
    parser.add_argument("--first-chunk-weight", type=float, default=3.0,
                        help="loss weight of a crop's opening (its first chunk, and the one after an independent "
                             "first frame: no context tells their colour, shape or direction) relative to the others")
    parser.add_argument("--frame-noise-fraction", type=float, default=0.0,
                        help="fraction of crops whose opening frames (the first chunk, and the one after an "
                             "independent first frame) get independent noise levels (diffusion forcing)")
    parser.add_argument("--start-fraction", type=float, default=0.5,
                        help="fraction of crops taken from the start of a clip, whose first latent frame the VAE "
                             "encodes (and decodes) as a video's first frame, as a rollout's first chunk is")
    parser.add_argument("--self-forcing-steps", type=int, default=800,
                        help="steps of the self-forcing stage after teacher forcing")
    parser.add_argument("--self-forcing-lr", type=float, default=2e-4)
    parser.add_argument("--self-forcing-batch", type=int, default=8)
    parser.add_argument("--text", choices=("words", "chars"), default="words")
    parser.add_argument("--fixed-batch", action="store_true",
                        help="reuse one batch (data and noise) for every transformer step (a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--output", default=None, help="folder for the CausalWanPipeline (save_pretrained)")
    parser.add_argument("--plot", default=None, help="PNG of the loss curves (needs matplotlib)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    return parser.parse_args(argv)


def sampling_config(args) -> CausalConfig:
    """:data:`SAMPLING` with the run's chunks: ``num_frames`` covers a first chunk and 8 more; chunk sizes are listed
    when the first chunk has its own size (a stream repeats the last one)."""
    first, chunk = args.first_chunk_frames, args.chunk_frames
    num_frames = first + 8 * chunk
    sizes = chunk if first == chunk else tuple(crop_sizes(num_frames, args))
    return SAMPLING.replace(chunk_frames=sizes, num_frames=num_frames)


def build_vae(seed: int) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, False], scale_factor_temporal=1, scale_factor_spatial=4)


def build_transformer(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=64, ffn_dim=256, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


STAGES = ("vae", "data", "teacher", "self_forcing")


def stage_rng(seed: int, stage: str) -> np.random.Generator:
    """Each stage draws from its own generator, so a run that loads the VAE a run trained (``--vae-from``) draws the
    same clips, batches and noise as that run: the transformer it trains is the same."""
    return np.random.default_rng([seed, STAGES.index(stage)])


def learning_rate(peak: float, step: int, steps: int, warmup: int, floor: float) -> float:
    """Linear warmup over ``warmup`` steps, then a cosine decay from ``peak`` to ``floor * peak``."""
    cosine = 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
    return peak * min(1.0, (step + 1) / max(1, warmup)) * (floor + (1 - floor) * cosine)


def smoothed(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# ---------------------------------------------------------------------------------------------------- VAE
def vae_batch(rng: np.random.Generator, batch: int, frames: int) -> torch.Tensor:
    clips = []
    for _ in range(batch):
        switch = int(rng.integers(1, frames)) if rng.random() < 0.2 else None
        clips.append(task.to_model_range(task.sample_clip(frames, rng, switch_at=switch).frames))
    return torch.cat(clips)


def vae_loss(vae: AutoencoderKLWan, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Weighted L1 + MSE (sprite pixels count 21 times) plus a small KL term; returns it and the plain pixel MSE."""
    posterior = vae.encode(x).latent_dist
    mu, logvar = posterior.mean, posterior.logvar
    z = mu + torch.randn(mu.shape, generator=generator) * posterior.std
    recon = vae.decode(z, return_dict=False)[0]
    background = torch.tensor(task.BACKGROUND).view(1, 3, 1, 1, 1) * 2 - 1
    weight = 1.0 + 20.0 * ((x - background).abs().sum(1, keepdim=True) > 0.1).float()
    error = recon - x
    reconstruction = (weight * (error.abs() + error**2)).mean()
    kl = 0.5 * (mu**2 + logvar.exp() - 1 - logvar).mean()
    return reconstruction + 1e-4 * kl, float((error.detach()**2).mean())


def train_vae(vae: AutoencoderKLWan, args, rng: np.random.Generator, log) -> list[float]:
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    vae.train()
    for step in range(args.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.vae_lr, step, args.vae_steps, 20, floor=0.1)
        loss, mse = vae_loss(vae, vae_batch(rng, args.vae_batch, VAE_CLIP_FRAMES), generator)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        losses.append(mse)
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.vae_steps:
            log(f"vae step {step + 1:5d}/{args.vae_steps}: pixel mse {mse:.5f} "
                f"(smoothed {smoothed(losses, 50)[-1]:.5f})")
    vae.eval()
    return losses


@torch.no_grad()
def encode_clips(vae: AutoencoderKLWan, clips: list[task.Clip], batch: int = 16) -> torch.Tensor:
    """Posterior means ``[clips, 16, frames, 8, 8]`` (raw, not normalised)."""
    out = []
    for i in range(0, len(clips), batch):
        x = torch.cat([task.to_model_range(c.frames) for c in clips[i:i + batch]])
        out.append(vae.encode(x).latent_dist.mean)
    return torch.cat(out)


def sprite_maps(clips: list[task.Clip], scale: int = 4) -> torch.Tensor:
    """``[clips, frames, 8, 8]``: 1 on the latent pixels whose ``scale x scale`` pixel patch the sprite touches, or
    a neighbour of one does (the background it leaves behind changes too), else 0."""
    frames = torch.from_numpy(np.stack([c.frames for c in clips]))  # [N, F, H, W, 3]
    covered = ((frames - torch.tensor(task.BACKGROUND)).abs().sum(-1) > 0.05).float()
    n, f, h, w = covered.shape
    pooled = F.max_pool2d(covered.view(n * f, 1, h, w), scale)
    return F.max_pool2d(pooled, 3, stride=1, padding=1).view(n, f, h // scale, w // scale)


def set_latent_statistics(vae: AutoencoderKLWan, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    return mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)


# ---------------------------------------------------------------------------------------------------- transformer
def make_dataset(args, rng: np.random.Generator) -> list[task.Clip]:
    """``--clips`` clips of ``--clip-frames`` frames; a ``--switch-fraction`` of them change colour at the middle
    frame (``clip_frames // 2``, where a training crop can put a chunk boundary)."""
    clips = []
    for _ in range(args.clips):
        switch = args.clip_frames // 2 if rng.random() < args.switch_fraction else None
        clips.append(task.sample_clip(args.clip_frames, rng, switch_at=switch))
    return clips


def crop(clip: task.Clip, args, rng: np.random.Generator) -> tuple[int, int]:
    """``(offset, first chunk with a loss)`` of a training crop: a switch clip's crop puts the switch on a chunk
    boundary after the first chunk and skips the loss of the chunks before it."""
    length = args.train_frames
    switch = next((i for i, p in enumerate(clip.prompts) if p != clip.prompts[0]), None)
    if switch is None:
        if args.start_fraction and rng.random() < args.start_fraction:
            return 0, 0
        return int(rng.integers(0, args.clip_frames - length + 1)), 0
    starts = np.cumsum(crop_sizes(length, args))[:-1]  # of chunks 1, 2, ...
    options = [k for k, start in enumerate(starts, 1) if 0 <= switch - start <= args.clip_frames - length]
    k = options[int(rng.integers(len(options)))]
    return switch - int(starts[k - 1]), k


def crop_sizes(frames: int, args) -> list[int]:
    """Chunk sizes of ``frames`` latent frames: a first chunk of ``--first-chunk-frames``, then chunks of
    ``--chunk-frames``."""
    first, chunk = args.first_chunk_frames, args.chunk_frames
    if frames <= first or (frames - first) % chunk:
        raise ValueError(f"{frames} latent frames do not split into a first chunk of {first} and chunks of {chunk}: "
                         f"pass --train-frames {first} + a multiple of {chunk}.")
    return [first] + [chunk] * ((frames - first) // chunk)


def opening_frames(sizes: list[int]) -> int:
    """Latent frames at a crop's start whose motion only the prompt gives: its first chunk, and after an independent
    first frame the chunk that follows it too."""
    return sizes[0] if sizes[0] > 1 or len(sizes) == 1 else sizes[0] + sizes[1]


def chunk_levels(batch: int, sizes: list[int], generator: torch.Generator) -> torch.Tensor:
    """``[batch, frames]`` noise levels in [0, 1): one per chunk of ``sizes`` frames, repeated over its frames."""
    return torch.rand(batch, len(sizes), generator=generator).repeat_interleave(torch.tensor(sizes), dim=1)


def training_batch(latents, maps, clips, embeds, args, rng, generator):
    """Normalised clean latents, noise, per-frame noise levels (one per chunk; independent per frame in the opening
    of a ``--frame-noise-fraction`` of the crops), prompt embeddings and per-latent-pixel loss weights
    ``[batch, frames, h, w]`` (zero on the chunks before a switch, ``--first-chunk-weight`` on the opening,
    ``1 + --sprite-weight`` where the sprite is)."""
    sizes = crop_sizes(args.train_frames, args)
    opening = opening_frames(sizes)
    index = rng.integers(0, len(clips), size=args.batch)
    clean, texts, weights = [], [], []
    for i in index:
        offset, first = crop(clips[i], args, rng)
        clean.append(latents[i, :, offset:offset + args.train_frames])
        # The prompt of the crop's first frame with a loss (a switch's new colour), naming the way the sprite moves
        # there: the clip's own prompt names its initial direction, which is wrong after a bounce.
        prompt = clips[i].moving_prompt(offset + sum(sizes[:first]))
        texts.append(embeds["" if rng.random() < args.text_dropout else prompt])
        per_frame = torch.ones(args.train_frames)
        per_frame[:sum(sizes[:first])] = 0.0
        if first == 0:
            per_frame[:opening] = args.first_chunk_weight
        sprite = maps[i, offset:offset + args.train_frames]
        weights.append(per_frame.view(-1, 1, 1) * (1 + args.sprite_weight * sprite))
    clean = torch.stack(clean)
    noise = torch.randn(clean.shape, generator=generator)
    levels = chunk_levels(args.batch, sizes, generator)
    if args.frame_noise_fraction:
        # Diffusion forcing in the opening: a frame noisier than its neighbours is placed from them and the prompt,
        # where one level for all of them lets the model read the sprite off the noisy frames alone.
        own = torch.rand(args.batch, generator=generator) < args.frame_noise_fraction
        levels[own, :opening] = torch.rand(int(own.sum()), opening, generator=generator)
    return clean, noise, levels, torch.cat(texts), torch.stack(weights)


def weighted_mse(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean squared error over channels, weighted per latent pixel by ``weights`` (``[batch, frames, h, w]``)."""
    per_pixel = ((prediction - target) ** 2).mean(dim=1)
    return (per_pixel * weights).sum() / weights.sum().clamp_min(1e-6)


def teacher_forcing_loss(transformer, clean, noise, levels, text, weights, sizes, context=None):
    """Flow matching of ``clean``'s chunks (of ``sizes`` frames) at noise ``levels`` (``[batch, frames]``), each
    noisy chunk attending to the clean chunks before it: those of ``context`` when given (the model's own frames, the
    self-forcing stage), else of ``clean`` itself."""
    batch, _, frames, height, width = clean.shape
    _, patch_h, patch_w = transformer.config.patch_size
    frame_tokens = (height // patch_h) * (width // patch_w)
    sigma = levels.view(batch, 1, frames, 1, 1)
    noisy = (1 - sigma) * clean + sigma * noise
    per_token = torch.cat([torch.zeros(batch, frames * frame_tokens),
                           (levels * 1000).repeat_interleave(frame_tokens, dim=1)], dim=1)
    with CausalContext(transformer, mode="teacher_forcing", chunk_frames=sizes):
        flow = transformer(hidden_states=torch.cat([clean if context is None else context, noisy], dim=2),
                           timestep=per_token, encoder_hidden_states=text, return_dict=False)[0][:, :, frames:]
    return weighted_mse(flow, noise - clean, weights)


def bidirectional_loss(transformer, clean, noise, levels, text, weights) -> torch.Tensor:
    """Full-sequence flow matching at one noise level per sample, stock attention (no context). Switch crops are
    left out: their prompt names the colour of the later frames only."""
    keep = weights.amin(dim=(2, 3)).min(dim=1).values > 0
    if not keep.any():
        keep[:] = True
    clean, noise, text, sigma = clean[keep], noise[keep], text[keep], levels[keep, :1]
    noisy = (1 - sigma.view(-1, 1, 1, 1, 1)) * clean + sigma.view(-1, 1, 1, 1, 1) * noise
    flow = transformer(hidden_states=noisy, timestep=sigma[:, 0] * 1000, encoder_hidden_states=text,
                       return_dict=False)[0]
    return weighted_mse(flow, noise - clean, weights[keep])


def train_transformer(transformer, latents, maps, clips, embeds, args, rng, log) -> dict[str, list[float]]:
    transformer.set_attn_processor(CausalWanAttnProcessor())
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses = {"teacher_forcing": [], "bidirectional": []}
    fixed = training_batch(latents, maps, clips, embeds, args, rng, generator) if args.fixed_batch else None
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, step, args.steps, args.warmup, floor=0.05)
        batch = fixed or training_batch(latents, maps, clips, embeds, args, rng, generator)
        bidirectional = not args.fixed_batch and rng.random() < args.bidirectional_fraction
        if bidirectional:
            loss = bidirectional_loss(transformer, *batch)
        else:
            loss = teacher_forcing_loss(transformer, *batch, crop_sizes(args.train_frames, args))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        losses["bidirectional" if bidirectional else "teacher_forcing"].append(loss.item())
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            tf = losses["teacher_forcing"]
            log(f"transformer step {step + 1:5d}/{args.steps}: "
                f"{'bidirectional' if bidirectional else 'teacher forcing'} loss {loss.item():.4f} "
                f"(teacher forcing, smoothed over 100: {smoothed(tf, 100)[-1] if tf else float('nan'):.4f})")
    transformer.eval()
    return losses


def self_forcing_loss(transformer, latents, maps, clips, embeds, args, rng, generator) -> torch.Tensor:
    """The teacher-forcing loss of a real clip's frames, with the model's own chunks as their context: the model first
    continues the clip's opening on its own (``self_forcing_rollout`` with the shipped timesteps, guidance 3.0
    against the empty prompt, without gradients; no window: a crop fits the training positions), then learns each
    real chunk from the chunks it made itself before it. Its own context drifts from the real one (slower, fainter,
    a little off), and this is what corrects that drift back onto the real path: exposure bias. A sprite's path is
    fixed by its first chunk (constant velocity, bounces), so the real continuation is the right target for the
    rollout's context.

    Why not regress the rollout's output on the clip directly (the gradient through the exit step, as Self-Forcing
    does with a distribution-matching loss): measured on this model, 600 such MSE steps faded the sprite (present in
    0.26 of the frames, from 0.89), the mean of the positions the model is unsure of."""
    sizes = crop_sizes(args.train_frames, args)
    steady = [i for i, clip in enumerate(clips) if len(set(clip.prompts)) == 1]  # one prompt: the rollout's own
    if not steady:
        raise ValueError("the self-forcing stage needs clips whose colour does not switch: lower --switch-fraction")
    index = [steady[k] for k in rng.integers(0, len(steady), size=args.self_forcing_batch)]
    last = args.clip_frames - args.train_frames
    offsets = [0 if args.start_fraction and rng.random() < args.start_fraction else int(rng.integers(0, last + 1))
               for _ in index]
    clean = torch.stack([latents[i, :, o:o + args.train_frames] for i, o in zip(index, offsets)])
    text = torch.cat([embeds[clips[i].moving_prompt(o)] for i, o in zip(index, offsets)])
    opening = opening_frames(sizes)  # real: its direction is the prompt's, which the teacher-forcing term trains
    first = clean[:, :, :opening]
    with torch.no_grad():
        own = self_forcing_rollout(transformer, torch.randn(clean[:, :, opening:].shape, generator=generator), text,
                                   context_latents=first, chunk_frames=sizes, timesteps=SAMPLING.timesteps,
                                   shift=SAMPLING.shift, exit_step=len(SAMPLING.timesteps) - 1,
                                   negative_prompt_embeds=embeds[""].expand_as(text),
                                   guidance_scale=ROLLOUT_GUIDANCE,
                                   cache_engines={"main": VanillaKVCacheEngine()}, generator=generator).latents
    weights = torch.stack([1 + args.sprite_weight * maps[i, o:o + args.train_frames] for i, o in zip(index, offsets)])
    weights[:, :opening] = 0  # no context of the model's own before it: the teacher-forcing term trains it
    noise = torch.randn(clean.shape, generator=generator)
    levels = chunk_levels(len(index), sizes, generator)
    return teacher_forcing_loss(transformer, clean, noise, levels, text, weights, sizes,
                                context=torch.cat([first, own], dim=2))


def train_self_forcing(transformer, latents, maps, clips, embeds, args, rng, log) -> list[float]:
    """The self-forcing stage: each step one self-forcing loss (clips with one prompt) plus one teacher-forcing loss
    (which keeps training the first chunk, which has no context of the model's own, and the prompt switches)."""
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.self_forcing_lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed + 2)
    losses = []
    for step in range(args.self_forcing_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.self_forcing_lr, step, args.self_forcing_steps, 20, floor=0.1)
        own = self_forcing_loss(transformer, latents, maps, clips, embeds, args, rng, generator)
        teacher = teacher_forcing_loss(transformer, *training_batch(latents, maps, clips, embeds, args, rng,
                                                                    generator), crop_sizes(args.train_frames, args))
        optimizer.zero_grad()
        (own + teacher).backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        losses.append(own.item())
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.self_forcing_steps:
            log(f"self-forcing step {step + 1:5d}/{args.self_forcing_steps}: own-context loss {own.item():.4f} "
                f"(smoothed over 100: {smoothed(losses, 100)[-1]:.4f}), teacher forcing {teacher.item():.4f}")
    transformer.eval()
    return losses


def plot_losses(path: str, vae_losses: list[float], losses: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot(vae_losses, alpha=0.3, color="C0")
    axes[0].plot(smoothed(vae_losses, 50), color="C0")
    axes[0].set(title="VAE: pixel MSE", xlabel="step", yscale="log")
    for i, (name, values) in enumerate(losses.items()):
        if values:
            axes[1].plot(values, alpha=0.25, color=f"C{i + 1}")
            axes[1].plot(smoothed(values, 100), color=f"C{i + 1}", label=name)
    axes[1].set(title="transformer: flow-matching loss", xlabel="step (per kind)", yscale="log")
    axes[1].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f} s] {message}", flush=True)

    if args.vae_from is None:
        vae = build_vae(args.seed)
        vae_losses = train_vae(vae, args, stage_rng(args.seed, "vae"), log)
    else:
        vae, vae_losses = AutoencoderKLWan.from_pretrained(args.vae_from), []
        log(f"VAE loaded from {args.vae_from}")
    vae.eval()
    vae_seconds = time.perf_counter() - began

    clips = make_dataset(args, stage_rng(args.seed, "data"))
    raw = encode_clips(vae, clips)
    mean, std = set_latent_statistics(vae, raw)
    latents = (raw - mean) / std
    log(f"encoded {len(clips)} clips of {args.clip_frames} frames -> latents {tuple(latents.shape[1:])}")

    if args.text == "words":
        text_encoder, tokenizer = sprite_text_encoder(seed=0), sprite_tokenizer()
    else:
        text_encoder, tokenizer = tiny_text_encoder(seed=0).requires_grad_(False), tiny_tokenizer()
    if args.transformer_from is None:
        transformer = build_transformer(args.seed)
    else:
        transformer = WanTransformer3DModel.from_pretrained(args.transformer_from)
        log(f"transformer loaded from {args.transformer_from}")
    pipe = CausalWanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                             scheduler=FlowMatchEulerDiscreteScheduler(shift=SAMPLING.shift),
                             causal_config=sampling_config(args))
    with torch.no_grad():
        embeds = {p: pipe.encode_prompt(p, do_classifier_free_guidance=False)[0] for p in task.PROMPTS + [""]}
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f} M parameters")
    transformer_began = time.perf_counter()
    maps = sprite_maps(clips)
    losses = train_transformer(transformer, latents, maps, clips, embeds, args, stage_rng(args.seed, "teacher"), log)
    transformer_seconds = time.perf_counter() - transformer_began
    self_forcing_began = time.perf_counter()
    losses["self_forcing"] = train_self_forcing(transformer, latents, maps, clips, embeds, args,
                                                stage_rng(args.seed, "self_forcing"), log)
    self_forcing_seconds = time.perf_counter() - self_forcing_began
    tf, sf = losses["teacher_forcing"], losses["self_forcing"]
    summary = {
        "command": "python examples/train_tiny_causal.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "vae_steps": 0 if args.vae_from else args.vae_steps, "vae_from": args.vae_from, "steps": args.steps,
        "seed": args.seed,
        "vae_seconds": round(vae_seconds, 1), "transformer_seconds": round(transformer_seconds, 1),
        "seconds": round(time.perf_counter() - began, 1),
        "vae_mse_last50": float(np.mean(vae_losses[-50:])) if vae_losses else None,
        "teacher_forcing_loss_first100": float(np.mean(tf[:100])) if tf else None,
        "teacher_forcing_loss_last100": float(np.mean(tf[-100:])) if tf else None,
        "bidirectional_loss_last100": (float(np.mean(losses["bidirectional"][-100:]))
                                       if losses["bidirectional"] else None),
        "self_forcing_steps": args.self_forcing_steps, "self_forcing_seconds": round(self_forcing_seconds, 1),
        "self_forcing_loss_first100": float(np.mean(sf[:100])) if sf else None,
        "self_forcing_loss_last100": float(np.mean(sf[-100:])) if sf else None,
    }
    if args.output is not None:
        pipe.save_pretrained(args.output, safe_serialization=True)
        with open(Path(args.output) / "training_summary.json", "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        log(f"wrote the pipeline to {args.output}")
    if args.plot is not None:
        plot_losses(args.plot, vae_losses, losses)
        log(f"wrote the loss plot to {args.plot}")
    print(json.dumps(summary))
    return {"summary": summary, "vae_losses": vae_losses, "losses": losses, "pipeline": pipe}


if __name__ == "__main__":
    main()
