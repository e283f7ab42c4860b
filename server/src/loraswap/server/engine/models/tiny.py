"""Tiny random-weight diffusers pipelines with the real FLUX.1 and SDXL architectures.

The builtin models let the server (and its tests) run real ``FluxPipeline`` /
``StableDiffusionXLPipeline`` code paths on any machine: everything is built
locally from configs and seeded initialisation, so nothing is downloaded and
every build yields bit-identical weights.  The images are noise, but the
pipelines exercise the same modules (attention projections, schedulers, VAE,
both text encoders, tokenizers) that real checkpoints have, which is what LoRA
loading and swapping need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    ModelMixin,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedModel,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from loraswap.server.engine.models.tokenizers import CLIP_MAX_LENGTH as _CLIP_MAX_LENGTH
from loraswap.server.engine.models.tokenizers import build_clip_tokenizer as _build_clip_tokenizer
from loraswap.server.engine.models.tokenizers import build_t5_tokenizer as _build_t5_tokenizer

__all__ = [
    "build_tiny_flux_pipeline",
    "build_tiny_sdxl_pipeline",
    "clip_text_config",
    "flux_dev_scheduler",
    "sdxl_base_scheduler",
    "t5_encoder_config",
]

_SEED = 0


# --------------------------------------------------------------------------- components


def clip_text_config(
    tokenizer: CLIPTokenizer,
    *,
    hidden_size: int = 32,
    intermediate_size: int = 37,
    projection_dim: int = 32,
    num_hidden_layers: int = 2,  # SDXL reads hidden_states[-2]
) -> CLIPTextConfig:
    """A small CLIP text encoder config wired to an offline tokenizer from tokenizers.py."""
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        # eos != 2 makes CLIP pool at the first EOS (not argmax of ids).
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        projection_dim=projection_dim,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )


def t5_encoder_config(
    tokenizer: T5TokenizerFast,
    *,
    d_model: int,
    d_kv: int = 8,
    d_ff: int = 64,
    num_layers: int = 2,
    relative_attention_max_distance: int = 32,
) -> T5Config:
    """A small T5 v1.1 encoder config (gated GELU, as FLUX uses) wired to an offline tokenizer."""
    return T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=num_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=relative_attention_max_distance,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
    )


def _seeded(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    # Reseed before each component so one component's size never shifts the
    # random stream (and hence the weights) of the next.
    torch.manual_seed(_SEED)
    module = factory()
    return module.eval()


def _tiny_flux_components() -> dict[str, Any]:
    tokenizer = _build_clip_tokenizer()
    tokenizer_2 = _build_t5_tokenizer()
    text_encoder = _seeded(lambda: CLIPTextModel(clip_text_config(tokenizer)))
    text_encoder_2 = _seeded(lambda: T5EncoderModel(t5_encoder_config(tokenizer_2, d_model=32)))
    latent_channels = 4
    vae = _seeded(
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=64,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
    )
    transformer = _seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=latent_channels * 4,  # FLUX packs 2x2 latent patches
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 d_model
            pooled_projection_dim=32,  # CLIP hidden size
            guidance_embeds=True,  # like FLUX.1-dev
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        )
    )
    scheduler = flux_dev_scheduler()
    return dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def flux_dev_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1-dev's scheduler, from its published config (resolution-dependent shift)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def sdxl_base_scheduler() -> EulerDiscreteScheduler:
    """SDXL base 1.0's scheduler, from its published config."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        steps_offset=1,
        timestep_spacing="leading",
    )


def _tiny_sdxl_components() -> dict[str, Any]:
    tokenizer = _build_clip_tokenizer()
    tokenizer_2 = _build_clip_tokenizer()
    text_encoder = _seeded(lambda: CLIPTextModel(clip_text_config(tokenizer)))
    text_encoder_2 = _seeded(lambda: CLIPTextModelWithProjection(clip_text_config(tokenizer_2)))
    vae = _seeded(
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=64,
            scaling_factor=0.13025,  # SDXL's value
        )
    )
    unet = _seeded(
        lambda: UNet2DConditionModel(
            sample_size=32,  # 64 px at vae_scale_factor 2: the pipeline default
            in_channels=4,
            out_channels=4,
            block_out_channels=(16, 32),
            norm_num_groups=8,
            layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 2),
            # 6 micro-conditioning ids * 8 + text_encoder_2 projection_dim 32
            projection_class_embeddings_input_dim=80,
            # concat of both text encoders' hidden states (32 + 32)
            cross_attention_dim=64,
        )
    )
    scheduler = sdxl_base_scheduler()
    return dict(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
    )


_BUILD_LOCK = threading.Lock()


@contextmanager
def _private_rng() -> Iterator[None]:
    # Weights are initialised on CPU only; fork_rng restores the caller's CPU
    # RNG state afterwards so a build never perturbs their random stream.  The
    # lock keeps concurrent builds from reseeding each other mid-build.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        yield


# --------------------------------------------------------------------------- public API


def _assemble(
    name: str,
    pipeline_cls: type[DiffusionPipeline],
    components_fn: Callable[[], dict[str, Any]],
    torch_dtype: torch.dtype,
) -> DiffusionPipeline:
    with _private_rng():
        components = components_fn()
    pipe = pipeline_cls(**components)
    # Record the builtin name (not a Hub repo id) as the origin everywhere a
    # name_or_path is kept, so nothing mistakes these models for Hub ones.
    pipe.register_to_config(_name_or_path=name)
    for module in components.values():
        if isinstance(module, PreTrainedModel):
            module.config._name_or_path = name
        elif isinstance(module, ModelMixin):
            module.register_to_config(_name_or_path=name)
    if torch_dtype != torch.float32:
        pipe.to(dtype=torch_dtype)
    return pipe


def build_tiny_flux_pipeline(torch_dtype: torch.dtype = torch.float32) -> FluxPipeline:
    """The `tiny-flux` model: a ``FluxPipeline`` on CPU with random but bit-identical weights on every call.

    The caller's global torch RNG state is left untouched; builds are
    serialised with each other, but another thread drawing from the global
    CPU RNG during a build would still change the weights. Height/width must
    be multiples of 4 (vae_scale_factor 2 times the 2x2 latent packing).
    """
    return _assemble("tiny-flux", FluxPipeline, _tiny_flux_components, torch_dtype)


def build_tiny_sdxl_pipeline(torch_dtype: torch.dtype = torch.float32) -> StableDiffusionXLPipeline:
    """The `tiny-sdxl` model: a ``StableDiffusionXLPipeline`` built as :func:`build_tiny_flux_pipeline` is.

    Height/width must be multiples of 2 (vae_scale_factor 2).
    """
    return _assemble("tiny-sdxl", StableDiffusionXLPipeline, _tiny_sdxl_components, torch_dtype)
