"""The parts the built-in random-weight pipelines are assembled from, shared by tiny.py and random_full.py.

Small text encoder and VAE configs, the published schedulers, seeded construction, and the assembly that
names a pipeline after its built-in model. Everything is built locally from configs and seeded
initialisation, so nothing is downloaded and every build yields bit-identical weights.
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
    ModelMixin,
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

from loraswap.server.engine.models.tokenizers import CLIP_MAX_LENGTH, build_clip_tokenizer, build_t5_tokenizer

__all__ = [
    "clip_text_config",
    "flux_components",
    "flux_dev_scheduler",
    "named_pipeline",
    "private_rng",
    "sdxl_base_scheduler",
    "sdxl_components",
    "seeded",
    "seeded_pipeline",
    "t5_encoder_config",
    "tiny_vae",
    "vae_levels",
]

_SEED = 0


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
        max_position_embeddings=CLIP_MAX_LENGTH,
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


def seeded(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`factory()` in eval mode, built right after seeding torch's CPU generator (call inside `private_rng`)."""
    # Reseed before each component so one component's size never shifts the
    # random stream (and hence the weights) of the next.
    torch.manual_seed(_SEED)
    module = factory()
    return module.eval()


_BUILD_LOCK = threading.Lock()


@contextmanager
def private_rng() -> Iterator[None]:
    """While a pipeline is built: the caller's CPU random stream saved and restored, other builds kept out."""
    # Weights are initialised on CPU only; fork_rng restores the caller's CPU
    # RNG state afterwards so a build never perturbs their random stream.  The
    # lock keeps concurrent builds from reseeding each other mid-build.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        yield


def vae_levels(block_out_channels: tuple[int, ...], sample_size: int) -> dict[str, Any]:
    """The tiny image autoencoders' layout (AutoencoderKL's and FLUX.2's): RGB in and out, one level per entry
    of `block_out_channels` (each level after the first halves the size), one layer a level, 4 norm groups."""
    levels = len(block_out_channels)
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=block_out_channels,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=sample_size,
    )


def tiny_vae(
    *,
    latent_channels: int,
    scaling_factor: float,
    shift_factor: float | None,
    block_out_channels: tuple[int, ...] = (8, 16),
    sample_size: int = 64,
) -> AutoencoderKL:
    """A seeded VAE with tiny widths: one level per entry of `block_out_channels`, each halving the size.

    A `shift_factor` makes it Flux's kind (no quant convs); None makes it SDXL's (with them).
    """
    return seeded(
        lambda: AutoencoderKL(
            **vae_levels(block_out_channels, sample_size),
            latent_channels=latent_channels,
            use_quant_conv=shift_factor is None,
            use_post_quant_conv=shift_factor is None,
            shift_factor=shift_factor,
            scaling_factor=scaling_factor,
        )
    )


def flux_components(transformer: ModelMixin, *, clip_width: int, t5_width: int, vae: AutoencoderKL) -> dict[str, Any]:
    """A ``FluxPipeline``'s components around `transformer`: seeded CLIP and T5 encoders of the widths it reads
    (pooled_projection_dim and joint_attention_dim), offline tokenizers, FLUX.1-dev's scheduler."""
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()
    text_encoder = seeded(
        lambda: CLIPTextModel(clip_text_config(tokenizer, hidden_size=clip_width, projection_dim=clip_width))
    )
    text_encoder_2 = seeded(lambda: T5EncoderModel(t5_encoder_config(tokenizer_2, d_model=t5_width)))
    return dict(
        scheduler=flux_dev_scheduler(), vae=vae, transformer=transformer,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
    )  # fmt: skip


def sdxl_components(unet: ModelMixin, *, clip_widths: tuple[int, int], vae: AutoencoderKL) -> dict[str, Any]:
    """A ``StableDiffusionXLPipeline``'s components around `unet`: two seeded CLIP encoders of the widths given
    (their hidden states, concatenated, are its cross_attention_dim), offline tokenizers, SDXL base's scheduler."""
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer()
    width, width_2 = clip_widths
    text_encoder = seeded(lambda: CLIPTextModel(clip_text_config(tokenizer, hidden_size=width, projection_dim=width)))
    text_encoder_2 = seeded(
        lambda: CLIPTextModelWithProjection(clip_text_config(tokenizer_2, hidden_size=width_2, projection_dim=width_2))
    )
    return dict(
        scheduler=sdxl_base_scheduler(), vae=vae, unet=unet,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
    )  # fmt: skip


def named_pipeline(name: str, pipeline_cls: type[DiffusionPipeline], components: dict[str, Any]) -> DiffusionPipeline:
    """The pipeline of `components`, with the built-in `name` recorded as its origin everywhere one is kept."""
    return with_origin(pipeline_cls(**components), name)


def with_origin(pipe: DiffusionPipeline, name: str) -> DiffusionPipeline:
    """`pipe` with the built-in `name` (not a Hub repo id, nor the folder it was loaded from) as every name_or_path,
    so nothing mistakes it for a Hub model and no exported folder carries this machine's paths."""
    pipe.register_to_config(_name_or_path=name)
    for module in pipe.components.values():
        if isinstance(module, PreTrainedModel):
            module.config._name_or_path = name
        elif isinstance(module, ModelMixin):
            module.register_to_config(_name_or_path=name)
    return pipe


def seeded_pipeline(
    name: str,
    pipeline_cls: type[DiffusionPipeline],
    components_fn: Callable[[], dict[str, Any]],
    torch_dtype: torch.dtype,
) -> DiffusionPipeline:
    """The built-in `name`: `pipeline_cls` of `components_fn()` (built with :func:`seeded` parts inside
    :func:`private_rng`), cast to `torch_dtype` after float32 initialisation, so every dtype has the same weights."""
    with private_rng():
        components = components_fn()
    pipe = named_pipeline(name, pipeline_cls, components)
    if torch_dtype != torch.float32:
        pipe.to(dtype=torch_dtype)
    return pipe
