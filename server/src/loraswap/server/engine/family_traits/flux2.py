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

    def classifier_free_guidance_above(self, pipe) -> float | None:
        # klein's base models run guidance above 1 as a second call against an empty prompt (Flux2KleinPipeline's
        # do_classifier_free_guidance); dev embeds its guidance and klein's distilled models ignore it.
        from diffusers import Flux2KleinPipeline

        return 1.0 if isinstance(pipe, Flux2KleinPipeline) and not pipe.config.is_distilled else None

    def spatial_latents(self, pipe, latents, height: int, width: int):
        # Tokens in row-major order, each a 2x2 patch of the VAE's channels: (batch, tokens, channels * 4).
        rows, columns = height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2)
        patches = latents.reshape(latents.shape[0], rows, columns, latents.shape[-1]).permute(0, 3, 1, 2)
        return pipe._unpatchify_latents(patches)


# Published latent-to-RGB factors of FLUX.2's VAE latent space (ComfyUI, comfy/latent_formats.py: Flux2), one row
# per VAE channel: ComfyUI applies them after un-patchifying the 128 channels the transformer sees into 32 at twice
# the resolution, as spatial_latents does. They apply to latents as the pipeline denoises them (batch-normalised).
FLUX2_LATENT_RGB = LatentRgb(
    factors=(
        (0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
        (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109),
        (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
        (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
        (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065),
        (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
        (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
        (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614),
    ),
    bias=(-0.0329, -0.0718, -0.0851),
)  # fmt: skip

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
    guidance_in_one_call=False,  # klein base's CFG is a second call
)  # fmt: skip
