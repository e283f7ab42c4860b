"""FLUX.2, dev and klein (Flux2Pipeline, Flux2KleinPipeline, Flux2Transformer2DModel).

Latents are patchified 2x2 and packed into tokens; the VAE's latents are the 4x fewer channels un-patchified.
dev embeds its guidance (one denoiser call a step); klein's distilled models ignore guidance, its base models run
classifier-free guidance against an empty prompt above 1. Neither pipeline takes negative prompt text. Modulation
is shared by all blocks of a stream (`double_stream_modulation_img`, ...), and a single-stream block fuses QKV
with the MLP's input in `attn.to_qkv_mlp_proj`.
"""

from __future__ import annotations

from typing import Any

from loraswap.server.engine.family_traits.base import PatchifiedTraits
from loraswap.server.engine.types import LatentRgb, ModelDefaults, ModelFamily


class Flux2Traits(PatchifiedTraits):
    def published_defaults(self, pipe) -> ModelDefaults:
        if getattr(pipe.config, "is_distilled", False):
            return ModelDefaults(1024, 1024, 4, 1.0, 512)  # FLUX.2 [klein], distilled
        return ModelDefaults(1024, 1024, 50, 4.0, 512)  # FLUX.2 [dev], FLUX.2 [klein] base

    def ignored_negative_prompt(self, defaults: ModelDefaults) -> str | None:
        return "negative_prompt is ignored: FLUX.2 pipelines take no negative prompt"

    def pipeline_kwargs(self, negative_prompt: str, guidance_scale: float, defaults: ModelDefaults) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale}

    def warm_up_guidance(self, defaults: ModelDefaults) -> tuple[float | None, ...]:
        # klein base runs guidance above 1 as a second call: cover both when the model's default is above 1.
        return (defaults.guidance_scale, 1.0) if defaults.guidance_scale > 1.0 else (None,)

    def spatial_latents(self, pipe, latents, height: int, width: int):
        # Tokens in row-major order, each a 2x2 patch of the VAE's channels: (batch, tokens, channels * 4).
        rows, columns = height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2)
        patches = latents.reshape(latents.shape[0], rows, columns, latents.shape[-1]).permute(0, 3, 1, 2)
        return pipe._unpatchify_latents(patches)


# FLUX.2's VAE has 32 latent channels; no published projection is carried yet: previews are grey.
FLUX2_LATENT_RGB = LatentRgb.grey(32)

FLUX2 = Flux2Traits(
    family=ModelFamily.FLUX2,
    pipeline_classes=("Flux2Pipeline", "Flux2KleinPipeline"),
    denoiser_attribute="transformer",
    adapter_prefix="transformer",
    default_target_modules=(
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
        "to_qkv_mlp_proj", "attn.to_out",
    ),
    convolutional_denoiser=False,
    text_encoders=(),  # Mistral 3 (dev), Qwen3 (klein); diffusers' loader reads no text-encoder LoRA for them
    # sd-scripts' and musubi-tuner's BFL names (`lora_unet_double_blocks_0_img_attn_qkv`), LyCORIS's diffusers names.
    kohya_prefixes={"lora_unet": "transformer", "lycoris": "transformer"},
    reads_module_path_files=True,
    latent_rgb=FLUX2_LATENT_RGB,
)  # fmt: skip
