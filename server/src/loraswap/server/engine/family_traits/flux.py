"""FLUX.1 (FluxPipeline, FluxTransformer2DModel): 2x2-packed latents, true CFG only when a model asks for it."""

from __future__ import annotations

from typing import Any

from loraswap.server.engine.family_traits.base import PatchifiedTraits
from loraswap.server.engine.types import LatentRgb, ModelDefaults, ModelFamily


class FluxTraits(PatchifiedTraits):
    def published_defaults(self, pipe) -> ModelDefaults:
        if getattr(pipe.transformer.config, "guidance_embeds", False):
            return ModelDefaults(1024, 1024, 28, 3.5, 512)  # Flux.1 [dev]
        return ModelDefaults(1024, 1024, 4, 0.0, 256)  # Flux.1 [schnell]

    def ignored_negative_prompt(self, defaults: ModelDefaults) -> str | None:
        if defaults.true_cfg_scale > 1.0:
            return None
        return "negative_prompt is ignored: this Flux pipeline runs without true classifier-free guidance"

    def pipeline_kwargs(self, negative_prompt: str, guidance_scale: float, defaults: ModelDefaults) -> dict[str, Any]:
        if defaults.true_cfg_scale > 1.0:
            return {
                "guidance_scale": guidance_scale, "true_cfg_scale": defaults.true_cfg_scale,
                "negative_prompt": negative_prompt,
            }  # fmt: skip
        return {"guidance_scale": guidance_scale}

    def guidance_batch(self, pipe, defaults: ModelDefaults, guidance: float) -> int:
        # A model that asks for true CFG (defaults.true_cfg_scale, e.g. shapes) runs it at every guidance.
        return 2 if defaults.true_cfg_scale > 1.0 else 1

    def spatial_latents(self, pipe, latents, height: int, width: int):
        # Flux denoises 2x2 latent patches packed into tokens: (batch, tokens, channels * 4).
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)

    def lora_state_dict(self, state_dict: dict, denoiser_config) -> tuple[dict, dict[str, float] | None]:
        from diffusers import FluxPipeline

        return FluxPipeline.lora_state_dict(state_dict, return_alphas=True)


# Published latent-to-RGB factors (ComfyUI, comfy/latent_formats.py: Flux), for latents as the pipeline denoises
# them (scaled and shifted by the VAE's factors); Z-Image shares FLUX.1's VAE and so its latent space.
FLUX_LATENT_RGB = LatentRgb(
    factors=(
        (-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433), (-0.0174, 0.0160, 0.0617),
        (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115), (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259),
        (-0.0245, 0.0250, 0.1180), (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
        (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499), (-0.1262, -0.0982, -0.0778),
    ),
    bias=(-0.0329, -0.0718, -0.0851),
)  # fmt: skip

FLUX = FluxTraits(
    family=ModelFamily.FLUX,
    pipeline_classes=("FluxPipeline",),
    denoiser_attribute="transformer",
    adapter_prefix="transformer",
    default_target_modules=(
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        "proj_mlp", "proj_out",
    ),
    convolutional_denoiser=False,
    text_encoders=("text_encoder", "text_encoder_2"),  # CLIP-L, T5
    # sd-scripts' BFL names (`lora_unet_double_blocks_0_img_attn_qkv`), ai-toolkit's and LyCORIS's diffusers names.
    kohya_prefixes={
        "lora_unet": "transformer", "lora_transformer": "transformer", "lycoris": "transformer",
        "lora_te1": "text_encoder",
    },
    latent_rgb=FLUX_LATENT_RGB,
    guidance_in_one_call=False,  # true CFG (a model that asks for it) is a second call
)  # fmt: skip
