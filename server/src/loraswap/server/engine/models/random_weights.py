"""How the full-size random-weight built-ins are made: a denoiser of the published shape with seeded random weights,
cut to a depth, and the pipeline of small stand-ins around it.

Swap costs depend on layer shapes, not on what the weights say, so a denoiser built from the published config
with random weights measures adapter swaps on any machine exactly as the real checkpoint would. Construction
is fast: the denoiser is built on the meta device, cast to the target dtype there, materialised with
``to_empty`` (on the GPU when there is one) and filled in place from a seeded generator (normal(0, 0.02) for
matrices, 1 for norm scales, 0 for biases), so it never exists in float32. The parts around it (text encoders,
VAE, tokenizers) are tiny seeded ones of the widths the denoiser reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import AutoencoderKL, DiffusionPipeline, ModelMixin

from loraswap.server.engine.models.components import named_pipeline, private_rng, tiny_vae

__all__ = [
    "STAND_IN_VAE_LEVELS",
    "assemble_around",
    "depth_cut",
    "fill_random",
    "flux1_stand_in_vae",
    "random_denoiser",
    "sdxl_stand_in_vae",
]

# The stand-in VAEs' levels: four give the real VAEs' downscale factor of 8, with tiny widths.
STAND_IN_VAE_LEVELS: dict[str, Any] = dict(block_out_channels=(8, 8, 16, 16), sample_size=128)

_SEED = 0
_INIT_STD = 0.02


def depth_cut(layers: int | None, full: int, unit: str) -> int:
    """How many of a denoiser's `full` repeated blocks (`unit`, e.g. "double-stream blocks") to build for `layers`.

    Raises:
        ValueError: for `layers` outside 1 to `full` (None is full depth).
    """
    if layers is None:
        return full
    if not 1 <= layers <= full:
        raise ValueError(f"layers is {layers}; use 1 to {full} {unit}, or None for full depth")
    return layers


@torch.no_grad()
def fill_random(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Initialise every parameter in place: norm scales 1, biases 0, everything else N(0, 0.02)."""
    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm)
    for submodule in module.modules():
        is_norm = isinstance(submodule, norms) or type(submodule).__name__ == "RMSNorm"
        for name, parameter in submodule.named_parameters(recurse=False):
            if name == "bias":
                parameter.zero_()
            elif is_norm:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, _INIT_STD, generator=generator)


def random_denoiser(name: str, cls: type[ModelMixin], config: dict[str, Any], torch_dtype: torch.dtype) -> ModelMixin:
    """`cls(**config)` with seeded random weights in `torch_dtype`, on the GPU if any, in eval mode, named `name`.

    Identical on every call on one device; the caller's RNG state is untouched. Tensors a module keeps outside
    its parameters and buffers stay on the meta device: the caller rebuilds those.
    """
    with torch.device("meta"):
        model = cls(**config)
    # Cast while the weights are still meta (free), then allocate once in the target dtype. On a CUDA machine the
    # weights are drawn on the GPU: seconds for FLUX.1's 12 B parameters instead of minutes on one CPU core (the
    # values then differ from the CPU draw's, which matters to nobody: they are random either way).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    fill_random(model, torch.Generator(device).manual_seed(_SEED))
    model.register_to_config(_name_or_path=name)
    return model.eval()


def sdxl_stand_in_vae() -> AutoencoderKL:
    """A tiny VAE with SDXL's shape rules: 4 latent channels, downscale factor 8, its scaling factor."""
    return tiny_vae(latent_channels=4, scaling_factor=0.13025, shift_factor=None, **STAND_IN_VAE_LEVELS)


def flux1_stand_in_vae() -> AutoencoderKL:
    """A tiny VAE of FLUX.1's kind with its real shape rules: 16 latent channels, downscale factor 8, its factors.

    Z-Image's VAE is FLUX.1's too.
    """
    return tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, **STAND_IN_VAE_LEVELS)


def assemble_around(
    name: str,
    pipeline_cls: type[DiffusionPipeline],
    denoiser: ModelMixin,
    components_fn: Callable[[ModelMixin], dict[str, Any]],
    torch_dtype: torch.dtype,
) -> DiffusionPipeline:
    """The built-in `name`: `pipeline_cls` of `components_fn(denoiser)`, every other part seeded and cast to
    `torch_dtype` (on CPU), identical on every call."""
    with private_rng():
        components = components_fn(denoiser)
    for module in components.values():
        if isinstance(module, torch.nn.Module) and module is not denoiser:
            module.to(dtype=torch_dtype)
    return named_pipeline(name, pipeline_cls, components)
