"""What differs between the served families, in one table.

loraswap serves diffusers' `FluxPipeline`, `StableDiffusionXLPipeline`, `QwenImagePipeline`, `ZImagePipeline`,
`Flux2Pipeline` and `Flux2KleinPipeline`, one family each but FLUX.2's two (family_traits/, one module a family).
Everything the engine does differently for them (where the denoiser sits, which layers adapters usually change, how
adapter keys are prefixed, which sizes are allowed, whether negative prompts are read, the
pipeline arguments that differ, the guidance settings a warm-up must cover) is a trait of the
resident family here; the rest of the engine asks `family_of(pipe)` instead of testing classes.

Importing this module imports neither torch nor diffusers; the methods that need them import
them when called.
"""

from __future__ import annotations

from loraswap.server.engine.family_traits.base import WARM_UP_GUIDANCE, FamilyTraits
from loraswap.server.engine.family_traits.flux import FLUX, FLUX_LATENT_RGB
from loraswap.server.engine.family_traits.flux2 import FLUX2
from loraswap.server.engine.family_traits.qwen_image import QWEN_IMAGE
from loraswap.server.engine.family_traits.sdxl import SDXL, SDXL_LATENT_RGB
from loraswap.server.engine.family_traits.z_image import Z_IMAGE
from loraswap.server.engine.types import ModelFamily

__all__ = [
    "FAMILIES",
    "FLUX",
    "FLUX2",
    "FLUX_LATENT_RGB",
    "QWEN_IMAGE",
    "SDXL",
    "SDXL_LATENT_RGB",
    "WARM_UP_GUIDANCE",
    "Z_IMAGE",
    "FamilyTraits",
    "family_of",
]

FAMILIES: dict[ModelFamily, FamilyTraits] = {
    traits.family: traits for traits in (FLUX, SDXL, QWEN_IMAGE, Z_IMAGE, FLUX2)
}


def family_of(pipe) -> FamilyTraits:
    """The traits of the pipeline's family, from its class.

    Raises:
        ValueError: for a pipeline of neither family.
    """
    import diffusers

    for traits in FAMILIES.values():
        if isinstance(pipe, tuple(getattr(diffusers, name) for name in traits.pipeline_classes)):
            return traits
    served = ", ".join(name for traits in FAMILIES.values() for name in traits.pipeline_classes)
    raise ValueError(f"{type(pipe).__name__} is not supported; loraswap serves {served}")
