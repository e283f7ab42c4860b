"""Stable Diffusion XL (StableDiffusionXLPipeline, UNet2DConditionModel): a convolutional UNet, CFG as batch 2."""

from __future__ import annotations

from typing import Any

from loraswap.server.engine.family_traits.base import FamilyTraits
from loraswap.server.engine.types import LatentRgb, ModelDefaults, ModelFamily


class SdxlTraits(FamilyTraits):
    def size_multiple(self, pipe) -> int:
        return 8

    def min_size(self, pipe) -> int:
        # Every UNet level at least 2 latent pixels wide.
        multiple = self.size_multiple(pipe)
        latent = 2 ** self.denoiser(pipe).num_upsamplers + 1
        return -(-latent * pipe.vae_scale_factor // multiple) * multiple

    def upsample_period(self, pipe) -> int | None:
        # The VAE factor times 2**num_upsamplers: diffusers' UNet passes explicit upsample sizes
        # when the latent is not a multiple of the latter.
        return pipe.vae_scale_factor * 2 ** self.denoiser(pipe).num_upsamplers

    def published_defaults(self, pipe) -> ModelDefaults:
        return ModelDefaults(1024, 1024, 30, 5.0)  # SDXL base

    def pipeline_kwargs(self, negative_prompt: str, guidance_scale: float, defaults: ModelDefaults) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt or None}

    def lora_state_dict(self, state_dict: dict, denoiser_config) -> tuple[dict, dict[str, float] | None]:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline.lora_state_dict(state_dict, unet_config=denoiser_config)


# Published latent-to-RGB factors (ComfyUI, comfy/latent_formats.py: SDXL), for latents as
# the pipeline denoises them (scaled and shifted by the VAE's factors).
SDXL_LATENT_RGB = LatentRgb(
    factors=(
        (0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362), (-0.3165, -0.2492, -0.2188),
    ),
    bias=(0.1084, -0.0175, -0.0011),
)  # fmt: skip
SDXL = SdxlTraits(
    family=ModelFamily.SDXL,
    pipeline_classes=("StableDiffusionXLPipeline",),
    denoiser_attribute="unet",
    adapter_prefix="unet",
    default_target_modules=(
        "to_q", "to_k", "to_v", "to_out.0",
        "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out",
    ),
    convolutional_denoiser=True,
    text_encoders=("text_encoder", "text_encoder_2"),  # CLIP-L, CLIP-G
    kohya_prefixes={
        "lora_unet": "unet", "lycoris": "unet",
        "lora_te": "text_encoder", "lora_te1": "text_encoder", "lora_te2": "text_encoder_2",
    },
    guidance_above=1.0,  # diffusers' do_classifier_free_guidance
    latent_rgb=SDXL_LATENT_RGB,
)  # fmt: skip
