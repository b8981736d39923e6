"""One teacher-forcing step and one self-forcing step on a stock diffusers Wan transformer, with an optimizer.

Everything is tiny and random, so it runs on a CPU in under ten seconds (most of them imports):

    python examples/train_step.py

* Teacher forcing (CausVid-style): one forward over ``[clean latents | noisy latents]`` under
  ``CausalContext(transformer, mode="teacher_forcing", chunk_frames=3)``; noisy chunk *k* attends to the clean
  chunks before it and to itself, each chunk at its own noise level (per-token timesteps). Loss: flow matching.
* Self-forcing: ``self_forcing_rollout`` generates the video chunk by chunk with the KV cache, keeping gradients
  for one denoising step per chunk; a DMD-style loss (distribution matching against a frozen bidirectional
  teacher and a critic, here random stand-ins sharing the generator's architecture) backpropagates through it.
  The teacher and the critic are the same stock transformer class without a context, so they run bidirectional
  stock attention inside the generator's training step.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from diffusers_causal_kv import CausalContext, CausalWanAttnProcessor, chunk_schedule, self_forcing_rollout
from diffusers_causal_kv.testing import tiny_prompt_encoder, tiny_wan


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent-frames", type=int, default=7, help="latent frames per sample")
    parser.add_argument("--chunk-frames", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def teacher_forcing_step(transformer, optimizer, clean, text, chunk_frames, generator) -> float:
    """Flow-matching loss on the noisy half of ``[clean | noisy]``, one noise level per chunk."""
    batch, _, frames, height, width = clean.shape
    frame_tokens = (height // 2) * (width // 2)  # patch size (1, 2, 2)
    sizes = chunk_schedule(frames, chunk_frames)
    levels = torch.rand(batch, len(sizes), generator=generator)  # sigma per sample and chunk
    sigma = torch.repeat_interleave(levels, torch.tensor(sizes), dim=1).view(batch, 1, frames, 1, 1)
    noise = torch.randn(clean.shape, generator=generator)
    noisy = (1 - sigma) * clean + sigma * noise
    per_token = torch.cat([
        torch.zeros(batch, frames * frame_tokens),  # the clean context sits at t=0
        torch.repeat_interleave(levels * 1000, torch.tensor(sizes) * frame_tokens, dim=1),
    ], dim=1)
    with CausalContext(transformer, mode="teacher_forcing", chunk_frames=chunk_frames):
        flow = transformer(hidden_states=torch.cat([clean, noisy], dim=2), timestep=per_token,
                           encoder_hidden_states=text, return_dict=False)[0]
    loss = F.mse_loss(flow[:, :, frames:], noise - clean)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def self_forcing_step(transformer, optimizer, teacher, critic, noise, text, chunk_frames, generator):
    """A DMD-style generator step: the rollout's latents move along (critic - teacher) x0 predictions."""
    result = self_forcing_rollout(transformer, noise, text, chunk_frames=chunk_frames, generator=generator)
    x = result.latents
    with torch.no_grad():
        sigma = torch.rand((), generator=generator) * 0.96 + 0.02
        noisy = (1 - sigma) * x + sigma * torch.randn(x.shape, generator=generator)
        t = torch.full((x.shape[0],), float(sigma * 1000))
        # Teacher and critic: plain stock forwards (no CausalContext of their own), bidirectional.
        x0_real = noisy - sigma * teacher(hidden_states=noisy, timestep=t, encoder_hidden_states=text,
                                          return_dict=False)[0]
        x0_fake = noisy - sigma * critic(hidden_states=noisy, timestep=t, encoder_hidden_states=text,
                                         return_dict=False)[0]
        direction = x0_fake - x0_real
        direction = direction / direction.abs().mean().clamp_min(1e-8)
    loss = 0.5 * F.mse_loss(x, (x - direction).detach())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item(), result.exit_steps


def main(argv=None) -> dict:
    args = parse_args(argv)
    transformer = tiny_wan(seed=args.seed, ffn_dim=64, init=None)  # the tiny model of examples/causal_rollout.py
    teacher = copy.deepcopy(transformer).requires_grad_(False).eval()
    critic = copy.deepcopy(teacher)  # in DMD the critic is trained on the generator's samples; here: perturbed
    with torch.no_grad():
        for param in critic.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    transformer.set_attn_processor(CausalWanAttnProcessor())
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr)

    g = torch.Generator().manual_seed(args.seed)
    text = tiny_prompt_encoder("a red fox running through fresh snow", batch=args.batch)
    shape = (args.batch, transformer.config.in_channels, args.latent_frames, 8, 8)
    clean = torch.randn(shape, generator=g)  # stands in for VAE latents of training videos

    tf_loss = teacher_forcing_step(transformer, optimizer, clean, text, args.chunk_frames, g)
    print(f"teacher forcing: flow-matching loss {tf_loss:.4f}")
    sf_loss, exits = self_forcing_step(transformer, optimizer, teacher, critic, torch.randn(shape, generator=g),
                                       text, args.chunk_frames, g)
    print(f"self forcing: DMD loss {sf_loss:.4f} (exit step {exits[0]} of every chunk)")
    return {"teacher_forcing_loss": tf_loss, "self_forcing_loss": sf_loss}


if __name__ == "__main__":
    main()
