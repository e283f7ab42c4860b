"""The untrained `shapes` pipeline components that training starts from (training only; never served)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import CLIPTextModel, T5EncoderModel

from loraswap.server.engine.models.tiny import clip_text_config, t5_encoder_config
from loraswap.server.engine.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer
from training.shapes_classifier import PALETTE, SHAPES

# Every word a caption can use; each is one T5 piece.
CAPTION_WORDS: tuple[str, ...] = (*PALETTE, *SHAPES, "a", "on", "background")


def untrained_shapes_components(seed: int = 0) -> dict[str, Any]:
    """Freshly initialised text encoders, tokenizers, transformer and scheduler, as training starts from."""
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer(CAPTION_WORDS)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        clip_text_config(tokenizer, hidden_size=64, intermediate_size=128, projection_dim=64, num_hidden_layers=1)
    )
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(
        t5_encoder_config(tokenizer_2, d_model=64, d_kv=16, d_ff=128, num_layers=1, relative_attention_max_distance=16)
    )
    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels in 2x2 packed patches
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    return dict(
        scheduler=scheduler,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
