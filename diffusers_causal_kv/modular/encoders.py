"""The causal block sets' encoder steps: the stock Wan ones with what the causal path needs changed."""

from __future__ import annotations

import torch
from diffusers.modular_pipelines.wan.encoders import WanTextEncoderStep, WanVaceEncoderStep, get_t5_prompt_embeds

from ..pipelines.inputs import causal_vace_mask


class CausalWanTextEncoderStep(WanTextEncoderStep):
    """The stock ``WanTextEncoderStep``, also without guidance: diffusers 0.42's ``encode_prompt`` ends in an
    ``UnboundLocalError`` when the guider needs no unconditional embeddings (``guidance_scale=1``, what distilled causal
    models use); this one returns ``None`` for them then, as the stock Wan pipelines do."""

    @staticmethod
    def encode_prompt(components, prompt, device=None, prepare_unconditional_embeds: bool = True,
                      negative_prompt=None, max_sequence_length: int = 512):
        if prepare_unconditional_embeds:
            return WanTextEncoderStep.encode_prompt(components, prompt, device, True, negative_prompt,
                                                    max_sequence_length)
        prompt_embeds = get_t5_prompt_embeds(
            text_encoder=components.text_encoder, tokenizer=components.tokenizer,
            prompt=prompt if isinstance(prompt, list) else [prompt], max_sequence_length=max_sequence_length,
            device=device or components._execution_device)
        return prompt_embeds, None


class CausalWanVaceEncoderStep(WanVaceEncoderStep):
    """The stock ``WanVaceEncoderStep`` with the control mask downsampled in time causally (latent frame ``j`` takes
    the mask of video frame ``4j``), as ``CausalWanPipeline`` does, instead of resampled over the whole video."""

    @staticmethod
    def prepare_masks(components, mask, reference_images):
        if any(len(images) for images in reference_images):
            raise ValueError("reference_images are not supported by the causal VACE path yet; drop them (they would "
                             "have to be prefilled before frame 0).")
        return torch.cat([causal_vace_mask(m[None], True, components.vae_scale_factor_spatial) for m in mask])
