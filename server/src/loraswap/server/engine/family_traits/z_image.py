"""Z-Image (ZImagePipeline, ZImageTransformer2DModel): spatial latents, classifier-free guidance above 0.

Z-Image runs classifier-free guidance whenever guidance_scale > 0, as one denoiser call of batch 2 (Turbo is
served at 0). Its latents are FLUX.1's VAE space, unpacked (the transformer patchifies inside). Its LoRAs change
attention and the feed-forward layers; ComfyUI-style files fuse `attention.qkv`, which diffusers' converter splits.
"""

from __future__ import annotations

from typing import Any

from loraswap.server.engine.family_traits.base import PatchifiedTraits
from loraswap.server.engine.family_traits.flux import FLUX_LATENT_RGB
from loraswap.server.engine.types import ModelDefaults, ModelFamily


class ZImageTraits(PatchifiedTraits):
    def token_padding(self, pipe) -> tuple[int, int] | None:
        from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

        return (pipe.vae_scale_factor * 2, SEQ_MULTI_OF)  # 2x2 patches of latents, padded to multiples of 32

    def published_defaults(self, pipe) -> ModelDefaults:
        return ModelDefaults(1024, 1024, 8, 0.0, 512)  # Tongyi-MAI/Z-Image-Turbo

    def pipeline_kwargs(self, negative_prompt: str, guidance_scale: float, defaults: ModelDefaults) -> dict[str, Any]:
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt or None}


Z_IMAGE = ZImageTraits(
    family=ModelFamily.Z_IMAGE,
    pipeline_classes=("ZImagePipeline",),
    denoiser_attribute="transformer",
    adapter_prefix="transformer",
    default_target_modules=(
        "to_q", "to_k", "to_v", "to_out.0",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
    ),
    convolutional_denoiser=False,
    text_encoders=(),  # Qwen3; diffusers' loader reads no text-encoder LoRA for this family
    # musubi-tuner's and sd-scripts' `lora_unet_layers_0_attention_to_q`, LyCORIS's diffusers names.
    kohya_prefixes={"lora_unet": "transformer", "lycoris": "transformer"},
    text_length_varies=True,  # each prompt unpadded, the transformer pads it to a multiple of 32
    reads_module_path_files=True,
    guidance_above=0.0,  # ZImagePipeline's do_classifier_free_guidance
    # Compiled whole, its forward branches in Python on each text's padding to 32 tokens and on which of a CFG
    # batch's texts is longer: a prompt and negative prompt of new lengths compile a new graph. Its repeated blocks
    # see none of that (the padding runs eagerly around them), so by default it compiles them only.
    compile_kind="regional",
    latent_rgb=FLUX_LATENT_RGB,
)  # fmt: skip
