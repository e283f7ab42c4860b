"""The parts the Qwen-Image, Z-Image and FLUX.2 built-ins are assembled from, shared by their tiny and random builds.

Text encoder configs (Qwen2.5-VL, Qwen3, Mistral 3) of a given shape, the published schedulers, the VAEs,
and each pipeline's components around a denoiser. Seeded and offline as components.py's FLUX.1 and SDXL parts
are. The text encoders are the real classes, so each pipeline reads them as it reads the real ones: the
hidden states it takes (the last for Qwen-Image, the one before for Z-Image, three stacked for FLUX.2) are
there, at the width its denoiser reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, ModelMixin
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

from loraswap.server.engine.models.chat_tokenizers import (
    flux2_dev_tokenizer,
    qwen3_chat_tokenizer,
    qwen_image_tokenizer,
)

# FLUX.2 publishes FLUX.1-dev's scheduler config (its pipelines pass `mu`, which needs dynamic shifting).
from loraswap.server.engine.models.components import flux_dev_scheduler, seeded, vae_levels

__all__ = [
    "FLUX2_DEV_TEXT_LAYERS",
    "FLUX2_KLEIN_TEXT_LAYERS",
    "TextShape",
    "flux2_dev_components",
    "flux2_klein_components",
    "flux2_vae",
    "qwen_image_components",
    "qwen_image_vae",
    "z_image_components",
]

# The text encoder layers FLUX.2's pipelines stack (text_encoder_out_layers: dev (10, 20, 30), klein (9, 18, 27)):
# the stand-ins are this deep so that the default call works, as it does with the real checkpoints.
FLUX2_DEV_TEXT_LAYERS = 31
FLUX2_KLEIN_TEXT_LAYERS = 28
_MAX_POSITIONS = 4096


@dataclass(frozen=True)
class TextShape:
    """A stand-in text encoder's shape: `width` is what the denoiser reads; the rest only sets its cost."""

    width: int
    layers: int = 2  # Z-Image reads the hidden state before the last
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 8
    intermediate: int = 24


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen/Qwen-Image's scheduler, from its published config."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )  # fmt: skip


def z_image_turbo_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Tongyi-MAI/Z-Image-Turbo's scheduler, from its published config (a fixed shift)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def _qwen25vl_config(tokenizer: PreTrainedTokenizerBase, shape: TextShape) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL's text model of `shape` (its head width is width / heads) and a vision tower of a few thousand
    parameters (the class always builds one; text-to-image never runs it)."""
    half = shape.width // shape.heads // 2
    temporal = half // 4
    # Multimodal RoPE sections sum to half the head width (Qwen2.5-VL-7B: [16, 24, 24] of 64).
    mrope_section = [temporal, (half - temporal) // 2, half - temporal - (half - temporal) // 2]
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=shape.width, intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            max_position_embeddings=_MAX_POSITIONS, rms_norm_eps=1e-6,
            rope_scaling={"type": "mrope", "mrope_section": mrope_section, "rope_theta": 1000000.0},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=shape.width,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )  # fmt: skip


def _qwen3_config(tokenizer: PreTrainedTokenizerBase, shape: TextShape) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=shape.width, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=_MAX_POSITIONS, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, use_cache=False, bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def _mistral3_config(tokenizer: PreTrainedTokenizerBase, shape: TextShape) -> Mistral3Config:
    """Mistral-Small-3.1's kind: a Mistral text model of `shape` and a tiny Pixtral tower (always built, never run)."""
    return Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=len(tokenizer), hidden_size=shape.width,
            intermediate_size=shape.intermediate, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=_MAX_POSITIONS,
            rms_norm_eps=1e-5, rope_theta=1000000000.0, sliding_window=None, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            image_size=32, patch_size=8, num_channels=3, head_dim=8,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1,
        projector_hidden_act="gelu", multimodal_projector_bias=False, tie_word_embeddings=False,
    )  # fmt: skip


def qwen_image_vae(
    *, base_dim: int, z_dim: int, dim_mult: list[int], temperal_downsample: list[bool], **latent_stats: Any
) -> AutoencoderKLQwenImage:
    """A seeded Qwen-Image VAE (causal 3D, Wan 2.1's kind): one level per `dim_mult` entry, each after the first
    halving the size (`temperal_downsample`: whether it halves time too); `latent_stats` (latents_mean,
    latents_std) default to the published ones."""
    return seeded(
        lambda: AutoencoderKLQwenImage(
            base_dim=base_dim, z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=1,
            temperal_downsample=temperal_downsample, **latent_stats,
        )
    )  # fmt: skip


def flux2_vae(*, latent_channels: int, block_out_channels: tuple[int, ...], sample_size: int) -> AutoencoderKLFlux2:
    """A seeded FLUX.2 VAE (with quant convs and the BatchNorm whose statistics normalise its latents)."""
    return seeded(
        lambda: AutoencoderKLFlux2(**vae_levels(block_out_channels, sample_size), latent_channels=latent_channels)
    )


def _around(
    transformer: ModelMixin,
    vae: ModelMixin,
    scheduler: FlowMatchEulerDiscreteScheduler,
    tokenizer: PreTrainedTokenizerBase,
    text_encoder: Callable[[PreTrainedTokenizerBase], PreTrainedModel],
    **config: Any,
) -> dict[str, Any]:
    """A one-text-encoder pipeline's components: `text_encoder(tokenizer)` seeded, the others as given."""
    return dict(
        scheduler=scheduler, vae=vae, text_encoder=seeded(lambda: text_encoder(tokenizer)), tokenizer=tokenizer,
        transformer=transformer, **config,
    )  # fmt: skip


def qwen_image_components(transformer: ModelMixin, *, text: TextShape, vae: ModelMixin) -> dict[str, Any]:
    """A ``QwenImagePipeline``'s components around `transformer`: a Qwen2.5-VL text encoder (the pipeline reads
    its last hidden state, `text.width` = joint_attention_dim), Qwen-Image's tokenizer and scheduler."""
    return _around(
        transformer, vae, qwen_image_scheduler(), qwen_image_tokenizer(),
        lambda tokenizer: Qwen2_5_VLForConditionalGeneration(_qwen25vl_config(tokenizer, text)),
    )  # fmt: skip


def z_image_components(transformer: ModelMixin, *, text: TextShape, vae: ModelMixin) -> dict[str, Any]:
    """A ``ZImagePipeline``'s components around `transformer`: a Qwen3 model (the pipeline reads the hidden state
    before the last, `text.width` = cap_feat_dim), Qwen3's chat tokenizer, Z-Image-Turbo's scheduler."""
    return _around(
        transformer, vae, z_image_turbo_scheduler(), qwen3_chat_tokenizer(),
        lambda tokenizer: Qwen3Model(_qwen3_config(tokenizer, text)),
    )  # fmt: skip


def flux2_klein_components(transformer: ModelMixin, *, text: TextShape, vae: ModelMixin) -> dict[str, Any]:
    """A distilled ``Flux2KleinPipeline``'s components around `transformer` (as FLUX.2-klein-4B's): a Qwen3 causal
    LM (FLUX2_KLEIN_TEXT_LAYERS deep: three layers stacked, joint_attention_dim = 3 * `text.width`), Qwen3's chat
    tokenizer, FLUX.2's scheduler."""
    return _around(
        transformer, vae, flux_dev_scheduler(), qwen3_chat_tokenizer(),
        lambda tokenizer: Qwen3ForCausalLM(_qwen3_config(tokenizer, text)), is_distilled=True,
    )  # fmt: skip


def flux2_dev_components(transformer: ModelMixin, *, text: TextShape, vae: ModelMixin) -> dict[str, Any]:
    """A ``Flux2Pipeline``'s components around `transformer`: a Mistral 3 model (FLUX2_DEV_TEXT_LAYERS deep: three
    layers stacked, joint_attention_dim = 3 * `text.width`), the tekken-like tokenizer, FLUX.2's scheduler."""
    return _around(
        transformer, vae, flux_dev_scheduler(), flux2_dev_tokenizer(),
        lambda tokenizer: Mistral3ForConditionalGeneration(_mistral3_config(tokenizer, text)),
    )  # fmt: skip
