"""What differs between Flux and SDXL, in one place.

loraswap serves diffusers' `FluxPipeline` and `StableDiffusionXLPipeline`. Everything the engine
does differently for the two (where the denoiser sits, which layers adapters usually change, how
adapter keys are prefixed, which sizes are allowed, whether negative prompts are read, the
pipeline arguments that differ, the guidance settings a warm-up must cover) is a trait of the
resident family here; the rest of the engine asks `family_of(pipe)` instead of testing classes.

Importing this module imports neither torch nor diffusers; the methods that need them import
them when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraswap.server.engine.types import LatentRgb, ModelDefaults, ModelFamily

# The guidance of a warm-up's guidance-on runs, when the model's default guidance is off.
WARM_UP_GUIDANCE = 5.0


@dataclass(frozen=True)
class FamilyTraits:
    """The facts and rules that depend on the resident pipeline's family."""

    family: ModelFamily
    pipeline_class: str  # the diffusers pipeline class (and its subclasses) of this family
    denoiser_attribute: str  # the pipeline attribute holding the denoiser
    adapter_prefix: str  # the component prefix of the denoiser's keys in a diffusers LoRA file
    # Layers an adapter may change, as module-name suffixes; the union of what the common trainers
    # (diffusers' dreambooth scripts, kohya, ai-toolkit) target on linear layers.
    default_target_modules: tuple[str, ...]
    # Whether the denoiser runs convolutions (whose CPU kernel choice can split compiled graphs).
    convolutional_denoiser: bool
    # The pipeline attributes of the text encoders, whose layers adapters may change too.
    text_encoders: tuple[str, ...]
    # kohya-style layer-name prefixes (sd-scripts, LyCORIS) this server reads itself -> the component they change
    # (adapters/formats/key_layouts.py); files in other layouts go through diffusers' converters.
    kohya_prefixes: Mapping[str, str]
    # The published latent-to-RGB projection of the family's VAE latent space, for step previews
    # (engine/pipeline/previews.py); a built-in model with a VAE of its own records its own (models/registry.py).
    latent_rgb: LatentRgb

    def denoiser(self, pipe):
        """The pipeline's denoiser: the module adapters change."""
        return getattr(pipe, self.denoiser_attribute)

    def size_multiple(self, pipe) -> int:
        """Width and height must be multiples of this."""
        raise NotImplementedError

    def min_size(self, pipe) -> int:
        """Smallest width or height accepted.

        Below it some dimension inside the denoiser is 1, which torch specialises, so each
        such request would compile its own graph.
        """
        raise NotImplementedError

    def upsample_period(self, pipe) -> int | None:
        """Pixels per step of the size classes that need graphs of their own (see warm_up.warm_up_sizes); None: one class."""
        return None

    def published_defaults(self, pipe) -> ModelDefaults:
        """The defaults the family's published checkpoints use, for a model folder that names none."""
        raise NotImplementedError

    def ignored_negative_prompt(self, defaults: ModelDefaults) -> str | None:
        """Why a model with these defaults ignores negative prompts (the warning a request gets); None: it reads them."""
        return None

    def pipeline_kwargs(self, negative_prompt: str, defaults: ModelDefaults) -> dict[str, Any]:
        """The pipeline arguments, beyond those both families take, that carry the negative prompt and its guidance."""
        raise NotImplementedError

    def warm_up_guidance(self, defaults: ModelDefaults) -> tuple[float | None, ...]:
        """The guidance settings (None: the default) a warm-up runs at each size so no later guidance compiles."""
        return (None,)

    def guidance_batch(self, guidance: float) -> int:
        """How many images the denoiser computes per step at this guidance scale (classifier-free guidance: 2)."""
        return 1

    def spatial_latents(self, pipe, latents, height: int, width: int):
        """The pipeline's latents during denoising as (batch, channels, height / f, width / f) images."""
        return latents

    def lora_state_dict(self, state_dict: dict, denoiser_config) -> tuple[dict, dict[str, float] | None]:
        """diffusers' own reading of a LoRA file for this family: (diffusers-format keys, alphas or None).

        Runs diffusers' converters (kohya, A1111, ComfyUI, xlabs, ...); they raise on layouts they cannot read.
        """
        raise NotImplementedError

    def save_lora_weights(self, directory: str | Path, state_dict: dict, metadata: dict) -> None:
        """Write the denoiser's LoRA `state_dict` (PEFT keys) as diffusers' `save_lora_weights` does."""
        import diffusers

        getattr(diffusers, self.pipeline_class).save_lora_weights(
            directory,
            **{
                f"{self.adapter_prefix}_lora_layers": state_dict,
                f"{self.adapter_prefix}_lora_adapter_metadata": metadata,
            },
        )


class _FluxTraits(FamilyTraits):
    def size_multiple(self, pipe) -> int:
        # The VAE's downscale factor times Flux's 2x2 latent packing.
        return pipe.vae_scale_factor * 2

    def min_size(self, pipe) -> int:
        # More than one packed token (a one-multiple square is one token).
        return 2 * self.size_multiple(pipe)

    def published_defaults(self, pipe) -> ModelDefaults:
        if getattr(pipe.transformer.config, "guidance_embeds", False):
            return ModelDefaults(1024, 1024, 28, 3.5, 512)  # Flux.1 [dev]
        return ModelDefaults(1024, 1024, 4, 0.0, 256)  # Flux.1 [schnell]

    def ignored_negative_prompt(self, defaults: ModelDefaults) -> str | None:
        if defaults.true_cfg_scale > 1.0:
            return None
        return "negative_prompt is ignored: this Flux pipeline runs without true classifier-free guidance"

    def pipeline_kwargs(self, negative_prompt: str, defaults: ModelDefaults) -> dict[str, Any]:
        if defaults.true_cfg_scale > 1.0:
            return {"true_cfg_scale": defaults.true_cfg_scale, "negative_prompt": negative_prompt}
        return {}

    def spatial_latents(self, pipe, latents, height: int, width: int):
        # Flux denoises 2x2 latent patches packed into tokens: (batch, tokens, channels * 4).
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)

    def lora_state_dict(self, state_dict: dict, denoiser_config) -> tuple[dict, dict[str, float] | None]:
        from diffusers import FluxPipeline

        return FluxPipeline.lora_state_dict(state_dict, return_alphas=True)


class _SdxlTraits(FamilyTraits):
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

    def pipeline_kwargs(self, negative_prompt: str, defaults: ModelDefaults) -> dict[str, Any]:
        return {"negative_prompt": negative_prompt or None}

    def warm_up_guidance(self, defaults: ModelDefaults) -> tuple[float | None, ...]:
        # Classifier-free guidance runs as batch 2 and guidance <= 1 as batch 1, a size-1
        # dimension torch specialises: each size needs both.
        guidance_on = defaults.guidance_scale if defaults.guidance_scale > 1.0 else WARM_UP_GUIDANCE
        return (guidance_on, 1.0)

    def guidance_batch(self, guidance: float) -> int:
        return 2 if guidance > 1.0 else 1  # diffusers' do_classifier_free_guidance

    def lora_state_dict(self, state_dict: dict, denoiser_config) -> tuple[dict, dict[str, float] | None]:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline.lora_state_dict(state_dict, unet_config=denoiser_config)


# Published latent-to-RGB factors (ComfyUI, comfy/latent_formats.py: SDXL and Flux), for latents as
# the pipelines denoise them (scaled and shifted by the VAE's factors).
SDXL_LATENT_RGB = LatentRgb(
    factors=(
        (0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362), (-0.3165, -0.2492, -0.2188),
    ),
    bias=(0.1084, -0.0175, -0.0011),
)  # fmt: skip
FLUX_LATENT_RGB = LatentRgb(
    factors=(
        (-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433), (-0.0174, 0.0160, 0.0617),
        (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115), (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259),
        (-0.0245, 0.0250, 0.1180), (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
        (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499), (-0.1262, -0.0982, -0.0778),
    ),
    bias=(-0.0329, -0.0718, -0.0851),
)  # fmt: skip

FLUX = _FluxTraits(
    family=ModelFamily.FLUX,
    pipeline_class="FluxPipeline",
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
)  # fmt: skip
SDXL = _SdxlTraits(
    family=ModelFamily.SDXL,
    pipeline_class="StableDiffusionXLPipeline",
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
    latent_rgb=SDXL_LATENT_RGB,
)  # fmt: skip

FAMILIES: dict[ModelFamily, FamilyTraits] = {traits.family: traits for traits in (FLUX, SDXL)}


def family_of(pipe) -> FamilyTraits:
    """The traits of the pipeline's family, from its class.

    Raises:
        ValueError: for a pipeline of neither family.
    """
    import diffusers

    for traits in FAMILIES.values():
        if isinstance(pipe, getattr(diffusers, traits.pipeline_class)):
            return traits
    raise ValueError(
        f"{type(pipe).__name__} is not supported; loraswap serves FluxPipeline and StableDiffusionXLPipeline"
    )
