"""Qwen-Image (QwenImagePipeline, QwenImageTransformer2DModel): 2x2-packed latents, true CFG as its guidance.

Qwen-Image embeds no guidance: its guidance is true classifier-free guidance (`true_cfg_scale`), two denoiser calls
of batch 1 a step, which diffusers runs only when a negative prompt is given (an empty one counts). So a request's
guidance_scale is the model's true_cfg_scale, and above 1 the negative prompt (the request's, "" when unset) is
passed. Its LoRAs change attention, the MLPs and often the per-block modulation (`img_mod.1`, `txt_mod.1`), which
ai-toolkit trains; diffusers reads transformer LoRAs only.
"""

from __future__ import annotations

from typing import Any

from loraswap.server.engine.family_traits.base import PatchifiedTraits
from loraswap.server.engine.types import LatentRgb, ModelDefaults, ModelFamily


class QwenImageTraits(PatchifiedTraits):
    def published_defaults(self, pipe) -> ModelDefaults:
        return ModelDefaults(1024, 1024, 50, 4.0, 512)  # Qwen/Qwen-Image: 50 steps, true_cfg_scale 4

    def pipeline_kwargs(self, negative_prompt: str, guidance_scale: float, defaults: ModelDefaults) -> dict[str, Any]:
        if guidance_scale > self.guidance_above:  # diffusers runs true CFG only when given a negative prompt
            return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt}
        return {"true_cfg_scale": guidance_scale}

    def latent_channels(self, pipe) -> int:
        return pipe.vae.config.z_dim

    def spatial_latents(self, pipe, latents, height: int, width: int):
        # Packed 2x2 patches (batch, tokens, channels * 4), unpacked to the VAE's (batch, channels, frames=1, h, w).
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)[:, :, 0]


# Published latent-to-RGB factors of Wan 2.1's VAE latent space, which Qwen-Image's VAE keeps (ComfyUI,
# comfy/latent_formats.py: Wan21, the format its QwenImage model declares), for latents as the pipeline denoises them
# (normalised by the VAE's latents_mean and latents_std).
QWEN_IMAGE_LATENT_RGB = LatentRgb(
    factors=(
        (-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747), (0.0372, 0.2344, 0.1420),
        (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665), (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975),
        (-0.0412, 0.0267, -0.1364), (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
        (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950), (0.1984, 0.0913, 0.1861),
    ),
    bias=(-0.1835, -0.0868, -0.3360),
)  # fmt: skip

QWEN_IMAGE = QwenImageTraits(
    family=ModelFamily.QWEN_IMAGE,
    pipeline_classes=("QwenImagePipeline",),
    denoiser_attribute="transformer",
    adapter_prefix="transformer",
    default_target_modules=(
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
        "img_mod.1", "txt_mod.1",
    ),
    convolutional_denoiser=False,
    text_encoders=(),  # Qwen2.5-VL; diffusers' loader reads no text-encoder LoRA for this family
    # musubi-tuner's and sd-scripts' `lora_unet_transformer_blocks_0_attn_to_q`, LyCORIS's diffusers names.
    kohya_prefixes={"lora_unet": "transformer", "lycoris": "transformer"},
    text_length_varies=True,  # padded to the longest prompt of a call, not to max_sequence_length
    reads_module_path_files=True,
    guidance_above=1.0,  # true CFG, two calls of batch 1
    guidance_in_one_call=False,
    latent_rgb=QWEN_IMAGE_LATENT_RGB,
)  # fmt: skip
