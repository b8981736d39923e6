"""Wan2.2 A14B's expert boundary as diffusers decides it (#26 case 7), in every path: rollout, pipeline (few-step and
scheduler sampling), stream and Modular.

diffusers' ``WanPipeline`` runs ``transformer`` when ``t >= boundary_timestep``, ``t`` the float32 timestep tensor it
hands the model and ``boundary_timestep = boundary_ratio * num_train_timesteps`` (pipelines/wan/pipeline_wan.py and
pipeline_wan_i2v.py). With I2V-A14B's ``boundary_ratio`` 0.9 and a few-step timestep of 900 at shift 1, sigma is
float32(0.9) and ``sigma * 1000`` is 899.99997... in double precision but 900.0 in the float32 tensor the model gets:
diffusers runs ``transformer`` there (900.0 >= 900.0), and so must the rollout. Each test records every denoising
forward of both experts and checks that it ran on the expert that rule picks for the timestep it received."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffusers_causal_kv import (
    CausalConfig,
    CausalWanAttnProcessor,
    CausalWanPipeline,
    RolloutPlanner,
    causal_rollout,
    get_current_context,
)
from diffusers_causal_kv.session import shifted_sigmas
from diffusers_causal_kv.testing import tiny_conditioning, tiny_pipeline_components, tiny_wan

BOUNDARY = 0.9  # Wan2.2 I2V-A14B's boundary_ratio
TIMESTEPS = (1000, 900, 500)  # at shift 1: 900 reaches the model as 900.0, from 899.99997 in double precision


class DiffusersRule:
    """Records the denoising forwards of two experts: the timestep received, the expert that ran, and the expert
    diffusers' rule picks for it (commits, which run on both experts, are left out)."""

    def __init__(self, transformer, transformer_2, boundary_ratio=BOUNDARY, num_train_timesteps=1000):
        self.boundary_timestep = boundary_ratio * num_train_timesteps  # as pipeline_wan.py computes it
        self.runs = []
        self._handles = [expert.register_forward_pre_hook(self._recorder(name), with_kwargs=True)
                         for name, expert in (("transformer", transformer), ("transformer_2", transformer_2))]

    def _recorder(self, name):
        def record(module, args, kwargs):
            if not get_current_context(module).store_kv:
                t = kwargs["timestep"].reshape(-1)[0]  # a 0-d float32 tensor, as diffusers' loop variable
                picked = "transformer" if t >= self.boundary_timestep else "transformer_2"
                self.runs.append((float(t), name, picked))
        return record

    def assert_agrees(self, at=900.0):
        for handle in self._handles:
            handle.remove()
        assert [(t, ran) for t, ran, _ in self.runs] == [(t, picked) for t, _, picked in self.runs]
        assert (at, "transformer", "transformer") in self.runs  # the boundary itself was reached, on the high side
        assert any(ran == "transformer_2" for _, ran, _ in self.runs)


def _experts(in_channels=16):
    experts = SimpleNamespace(transformer=tiny_wan(seed=0, in_channels=in_channels),
                              transformer_2=tiny_wan(seed=1, in_channels=in_channels),
                              config=SimpleNamespace(boundary_ratio=BOUNDARY, expand_timesteps=False))
    for transformer in (experts.transformer, experts.transformer_2):
        transformer.set_attn_processor(CausalWanAttnProcessor())
    return experts


def _pipe(**config):
    return CausalWanPipeline(**tiny_pipeline_components(tiny_wan(seed=0)), transformer_2=tiny_wan(seed=1),
                             boundary_ratio=BOUNDARY,
                             causal_config=CausalConfig(chunk_frames=1, timesteps=TIMESTEPS, shift=1.0, num_frames=9,
                                                        **config))


def test_the_boundary_is_compared_on_the_float32_timestep():
    sigma = shifted_sigmas([900], shift=1.0)[0].item()
    assert sigma * 1000 < 900.0 and torch.tensor(sigma * 1000, dtype=torch.float32).item() == 900.0
    experts = _experts()
    planner = RolloutPlanner(experts, tiny_conditioning(experts.transformer, batch=1)[0])
    assert planner.expert_for(sigma * 1000).transformer is experts.transformer  # was transformer_2
    assert planner.expert_for(torch.tensor(900.0)).transformer is experts.transformer
    below = torch.nextafter(torch.tensor(900.0), torch.tensor(0.0)).item()  # the largest float32 below 900
    assert planner.expert_for(below).transformer is experts.transformer_2


def test_rollout():
    experts = _experts(in_channels=36)  # I2V-A14B: condition latents beside the noise
    rule = DiffusersRule(experts.transformer, experts.transformer_2)
    g = torch.Generator().manual_seed(0)
    noise, condition = torch.randn(1, 16, 2, 4, 4, generator=g), torch.randn(1, 20, 2, 4, 4, generator=g)
    causal_rollout(experts, noise, tiny_conditioning(experts.transformer, batch=1)[0], condition_latents=condition,
                   chunk_frames=1, timesteps=TIMESTEPS, shift=1.0, progress=False)
    rule.assert_agrees()


@pytest.mark.parametrize("sampling", ["few-step", "scheduler"])
def test_pipeline(sampling):
    pipe = _pipe()
    rule = DiffusersRule(pipe.transformer, pipe.transformer_2,
                         num_train_timesteps=pipe.scheduler.config.num_train_timesteps)
    steps = {"num_inference_steps": 10} if sampling == "scheduler" else {}
    pipe("a ball", height=32, width=32, max_sequence_length=16, output_type="latent",
         generator=torch.Generator().manual_seed(1), **steps)
    if sampling == "few-step":
        rule.assert_agrees()
    else:  # the scheduler's own float32 timesteps, on either side of the boundary
        rule.assert_agrees(at=next(t for t, ran, _ in rule.runs if ran == "transformer" and t < 1000))


def test_stream():
    pipe = _pipe()
    rule = DiffusersRule(pipe.transformer, pipe.transformer_2)
    list(pipe.stream("a ball", height=32, width=32, num_frames=9, max_sequence_length=16, output_type="latent",
                     generator=torch.Generator().manual_seed(1)))
    rule.assert_agrees()


def test_modular():
    from diffusers.guiders import ClassifierFreeGuidance

    from diffusers_causal_kv import causal_wan22_blocks

    pipe = _pipe()
    blocks = causal_wan22_blocks()
    for name in ("text_encoder", "decode"):
        blocks.sub_blocks.pop(name)
    modular = blocks.init_pipeline()
    modular.update_components(transformer=pipe.transformer, transformer_2=pipe.transformer_2,
                              guider=ClassifierFreeGuidance(guidance_scale=1.0),
                              guider_2=ClassifierFreeGuidance(guidance_scale=1.0))
    modular.register_to_config(boundary_ratio=BOUNDARY)
    positive, _ = pipe.encode_prompt("a ball", None, do_classifier_free_guidance=False, max_sequence_length=16,
                                     device=torch.device("cpu"))
    rule = DiffusersRule(pipe.transformer, pipe.transformer_2)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    modular(prompt_embeds=positive, latents=noise, chunk_frames=1, timesteps=TIMESTEPS, shift=1.0,
            generator=torch.Generator().manual_seed(3), output="latents")
    rule.assert_agrees()
