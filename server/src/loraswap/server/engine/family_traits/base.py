"""FamilyTraits: the facts and rules that depend on the resident pipeline's family, and their defaults.

Each family's module (flux.py, sdxl.py, ...) declares one instance; engine/families.py is the table of them.
Importing this module imports neither torch nor diffusers; the methods that need them import them when called.
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
    # The diffusers pipeline classes (and their subclasses) of this family; the first writes its LoRA files.
    pipeline_classes: tuple[str, ...]
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
    # Whether the text stream's length follows the prompt (no padding to max_sequence_length): its graphs must then
    # see two lengths at warm-up, so that the length is dynamic before any request comes (warm_up_shapes.py).
    text_length_varies: bool = False
    # Whether its files keyed by module path (ComfyUI's and ai-toolkit's `diffusion_model.`, PEFT's
    # `base_model.model.`) are read as the kohya-style names they spell, and its diffusers-named files are normalised
    # before diffusers' converter (adapters/formats/comfy_names.py, diffusers_keys.py): the newer families, whose
    # converters drop or break such files. FLUX.1's and SDXL's files reach their converters as they always did.
    reads_module_path_files: bool = False
    # The guidance above which the pipeline runs classifier-free guidance (a second image per step: a batch of 2,
    # or a second call); None: it never does (guidance embedded, or none), or the family says so itself.
    guidance_above: float | None = None
    # Whether classifier-free guidance runs its two images as one denoiser call of batch 2 (SDXL, Z-Image); False:
    # as two calls of batch 1 (true CFG: FLUX.1's, Qwen-Image's, FLUX.2 klein base's), so each call's batch stays 1.
    guidance_in_one_call: bool = True
    # The torch.compile kind a CUDA server uses when --compile is unset (compile_options.py).
    compile_kind: str = "full"

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

    def min_steps(self, pipe) -> int:
        """Fewest denoising steps the pipeline's scheduler can take: 2 for a flow-matching schedule stretched to a
        terminal shift (Qwen-Image's), whose stretch divides by zero at one step and gives non-finite latents."""
        return 2 if getattr(pipe.scheduler.config, "shift_terminal", None) else 1

    def upsample_period(self, pipe) -> int | None:
        """Pixels per step of the size classes that need graphs of their own (see warm_up.warm_up_sizes); None: one class."""
        return None

    def token_padding(self, pipe) -> tuple[int, int] | None:
        """(pixels per image-token side, period) where the denoiser pads its image tokens to a multiple of the
        period only when they fall short (a guard each graph splits sizes by: warm_up_shapes.token_class_sizes);
        None: no such padding."""
        return None

    def published_defaults(self, pipe) -> ModelDefaults:
        """The defaults the family's published checkpoints use, for a model folder that names none."""
        raise NotImplementedError

    def ignored_negative_prompt(self, defaults: ModelDefaults) -> str | None:
        """Why a model with these defaults ignores negative prompts (the warning a request gets); None: it reads them."""
        return None

    def pipeline_kwargs(self, negative_prompt: str, guidance_scale: float, defaults: ModelDefaults) -> dict[str, Any]:
        """The pipeline arguments, beyond those every family takes, that carry the guidance and the negative prompt."""
        raise NotImplementedError

    def classifier_free_guidance_above(self, pipe) -> float | None:
        """The guidance above which this pipeline runs classifier-free guidance; None: it never does. The family's
        `guidance_above` unless its pipelines differ (FLUX.2: only klein's base models do)."""
        return self.guidance_above

    def warm_up_guidance(self, pipe, defaults: ModelDefaults) -> tuple[float | None, ...]:
        """The guidance settings (None: the default) a warm-up runs at each size so no later guidance compiles."""
        above = self.classifier_free_guidance_above(pipe)
        if above is None:
            return (None,)
        # Guidance on runs a second image per step and off does not, a size-1 dimension torch specialises: each
        # size needs both.
        return (defaults.guidance_scale if defaults.guidance_scale > above else WARM_UP_GUIDANCE, above)

    def guidance_batch(self, pipe, defaults: ModelDefaults, guidance: float) -> int:
        """How many images the denoiser computes per step at this guidance scale (classifier-free guidance: 2, as a
        batch of 2 or as a second call) for a model with these defaults."""
        above = self.classifier_free_guidance_above(pipe)
        return 2 if above is not None and guidance > above else 1

    def call_batch(self, pipe, defaults: ModelDefaults, guidance: float) -> int:
        """The batch of each denoiser call at this guidance scale (what its attention runs at)."""
        return self.guidance_batch(pipe, defaults, guidance) if self.guidance_in_one_call else 1

    def latent_channels(self, pipe) -> int:
        """The channels of the latents spatial_latents gives (the VAE's latent space)."""
        return pipe.vae.config.latent_channels

    def spatial_latents(self, pipe, latents, height: int, width: int):
        """The pipeline's latents during denoising as (batch, channels, height / f, width / f) images."""
        return latents

    def lora_state_dict(self, state_dict: dict, denoiser_config) -> tuple[dict, dict[str, float] | None]:
        """diffusers' own reading of a LoRA file for this family: (diffusers-format keys, alphas or None).

        Runs diffusers' converters (kohya, A1111, ComfyUI, xlabs, ...); they raise on layouts they cannot read. This
        default is the newer families': their converters fold each alpha into the factors, so none come back.
        """
        import diffusers

        return getattr(diffusers, self.pipeline_classes[0]).lora_state_dict(state_dict), None

    def save_lora_weights(self, directory: str | Path, state_dict: dict, metadata: dict) -> None:
        """Write the denoiser's LoRA `state_dict` (PEFT keys) as diffusers' `save_lora_weights` does."""
        import diffusers

        getattr(diffusers, self.pipeline_classes[0]).save_lora_weights(
            directory,
            **{
                f"{self.adapter_prefix}_lora_layers": state_dict,
                f"{self.adapter_prefix}_lora_adapter_metadata": metadata,
            },
        )


class PatchifiedTraits(FamilyTraits):
    """A transformer denoiser over 2x2 patches of latents: sizes are multiples of the VAE's factor times 2."""

    def size_multiple(self, pipe) -> int:
        # The VAE's downscale factor times the 2x2 latent patches.
        return pipe.vae_scale_factor * 2

    def min_size(self, pipe) -> int:
        # More than one patch (a one-multiple square is one token).
        return 2 * self.size_multiple(pipe)
