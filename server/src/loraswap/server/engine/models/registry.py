"""The built-in models, by name: one table of how to build each and what fits it.

``shapes`` (the default) is a tiny trained FLUX pipeline that draws simple shapes from
text, shipped with demo adapters; ``tiny-flux`` and ``tiny-sdxl`` are random-weight
pipelines with the real architectures, for tests, as are ``tiny-qwen-image``,
``tiny-z-image``, ``tiny-flux2`` (FLUX.2 [dev]) and ``tiny-flux2-klein``; ``random-flux``,
``random-sdxl``, ``random-qwen-image``, ``random-z-image`` and ``random-flux2-klein`` wrap
the full-size denoisers with random weights, to measure swaps on real layer shapes.
Any other ``--model`` value is a diffusers folder or Hub id (loading.py).

Importing this module imports neither torch nor diffusers (the command line lists the
names); a model's builder imports them when called.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraswap.server.engine.adapters.sources import (
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX_DEV,
    QWEN_IMAGE,
    SDXL_BASE,
    Z_IMAGE_TURBO,
)
from loraswap.server.engine.models.shapes import SHAPES_LATENT_RGB, SHAPES_MAX_SEQUENCE_LENGTH, shapes_adapter_dir
from loraswap.server.engine.types import LatentRgb, ModelDefaults

__all__ = [
    "BUILTINS",
    "GENERATION_DEFAULTS_FILE",
    "BuiltinModel",
    "builtin_model",
    "layers_refused",
    "save_model_folder",
]

# Written beside model_index.json: the generation defaults (size, steps, guidance,
# sequence length) that fit the model; read by the engine when serving a folder.
GENERATION_DEFAULTS_FILE = "loraswap_generation.json"
# The shapes model is trained here: adapters for it declare this id (it names no Hub repo of anyone else's).
SHAPES_BASE = "loraswap/shapes"


@dataclass(frozen=True)
class BuiltinModel:
    """A model served by name: how to build it, the generation defaults that fit it, and how it may be used."""

    name: str
    # (torch dtype, layers or None) -> the pipeline on CPU, identical on every call.
    builder: Callable[[Any, int | None], Any]
    defaults: ModelDefaults
    # The base model adapters for it declare (GetServerInfo's base_model), in the vocabulary of
    # adapters/sources/base_model.py.
    base_model: str
    # The dtype it serves in when --dtype is unset; None: bfloat16 on CUDA, float32 on CPU.
    dtype: str | None = None
    # Demo adapters shipped with it, served when no --adapter-dir is given.
    adapter_dir: Path | None = None
    # Whether --layers (a depth cut) applies to it.
    takes_layers: bool = False
    # Whether `loraswap export-model` writes it as a diffusers folder.
    exportable: bool = True
    # The step previews' latent-to-RGB projection when its VAE is its own; None: its family's published one.
    latent_rgb: LatentRgb | None = None

    def build(self, torch_dtype=None, layers: int | None = None):
        """The pipeline on CPU in `torch_dtype` (None: its serving dtype on CPU), identical on every call.

        Raises:
            ValueError: for `layers` given to a model that takes none, or out of its range.
        """
        if layers is not None and not self.takes_layers:
            raise ValueError(layers_refused(self.name))
        if torch_dtype is None:
            import torch

            torch_dtype = getattr(torch, self.dtype or "float32")
        return self.builder(torch_dtype, layers)

    def export(self, directory: str | os.PathLike[str]) -> Path:
        """Write the model to `directory` as a float32 diffusers folder, with its generation defaults.

        Float32, whatever the model ships in, so that any loader (with or without a
        ``torch_dtype``) gets the weights the engine runs on CPU. Shipped adapters stay out.
        The folder loads offline with ``DiffusionPipeline.from_pretrained`` and serves with
        ``--model DIR``; images agree with the in-memory build to float rounding.

        Raises:
            ValueError: for a model export-model does not write (the full-size random ones).
        """
        if not self.exportable:
            raise ValueError(
                f"{self.name} is not exported; serve it by name (exportable models: {', '.join(_exportable())})"
            )
        import torch

        return save_model_folder(self.build(torch.float32), directory, self.defaults)


def save_model_folder(pipe, directory: str | os.PathLike[str], defaults: ModelDefaults) -> Path:
    """Save `pipe` as a diffusers folder (safetensors) with `defaults` in GENERATION_DEFAULTS_FILE beside it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    # The model's generation settings travel with it, so `loraswap serve --model DIR` uses them.
    (path / GENERATION_DEFAULTS_FILE).write_text(json.dumps(defaults.to_dict(), indent=2) + "\n")
    return path


def _shapes(torch_dtype, layers):
    from loraswap.server.engine.models.shapes import build_shapes_pipeline

    return build_shapes_pipeline(torch_dtype)


def _tiny_flux(torch_dtype, layers):
    from loraswap.server.engine.models.tiny import build_tiny_flux_pipeline

    return build_tiny_flux_pipeline(torch_dtype)


def _tiny_sdxl(torch_dtype, layers):
    from loraswap.server.engine.models.tiny import build_tiny_sdxl_pipeline

    return build_tiny_sdxl_pipeline(torch_dtype)


def _random_flux(torch_dtype, layers):
    from loraswap.server.engine.models.random_full import build_random_flux_pipeline

    return build_random_flux_pipeline(torch_dtype, layers)


def _random_sdxl(torch_dtype, layers):
    from loraswap.server.engine.models.random_full import build_random_sdxl_pipeline

    return build_random_sdxl_pipeline(torch_dtype)


def _tiny_family(name: str, base_model: str, **guidance: Any) -> BuiltinModel:
    """The model `name` of tiny_families.py: 64 px and 4 steps (a CPU test's size), with `guidance` (the
    ModelDefaults fields that follow how the family is published to run)."""

    def build(torch_dtype, layers):
        from loraswap.server.engine.models.tiny_families import build_tiny_family_pipeline

        return build_tiny_family_pipeline(name, torch_dtype)

    defaults = ModelDefaults(width=64, height=64, num_inference_steps=4, **guidance)
    return BuiltinModel(name=name, builder=build, defaults=defaults, base_model=base_model)


def _random_family(name: str, base_model: str, **guidance: Any) -> BuiltinModel:
    """The model `name` of random_families.py: full-size, so served as random-flux is (bf16, --layers, not exported)."""

    def build(torch_dtype, layers):
        from loraswap.server.engine.models.random_families import build_random_family_pipeline

        return build_random_family_pipeline(name, torch_dtype, layers)

    defaults = ModelDefaults(width=128, height=128, num_inference_steps=4, **guidance)
    return BuiltinModel(
        name=name, builder=build, defaults=defaults, base_model=base_model, dtype="bfloat16", takes_layers=True,
        exportable=False,
    )  # fmt: skip


# How the newer families are published to run: Qwen-Image with true CFG 4 (its family passes guidance_scale as
# true_cfg_scale: it embeds no guidance), Z-Image-Turbo without guidance, FLUX.2 [dev] with
# guidance embedded, klein-4B distilled (none). Sequence lengths are short as tiny-flux's; FLUX.2 [dev] always
# prepends a 35-token system prompt, so 64 leaves it room for the prompt.
_QWEN_IMAGE_GUIDANCE: dict[str, Any] = dict(guidance_scale=4.0, max_sequence_length=32)
_Z_IMAGE_TURBO_GUIDANCE: dict[str, Any] = dict(guidance_scale=0.0, max_sequence_length=32)
_FLUX2_DEV_GUIDANCE: dict[str, Any] = dict(guidance_scale=4.0, max_sequence_length=64)
_FLUX2_KLEIN_GUIDANCE: dict[str, Any] = dict(guidance_scale=1.0, max_sequence_length=32)


BUILTINS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            name="shapes",
            builder=_shapes,
            # True CFG against an empty negative prompt is what makes colors and backgrounds
            # follow the caption; guidance_scale 1: the model has no guidance embedding.
            defaults=ModelDefaults(
                width=64, height=64, num_inference_steps=20, guidance_scale=1.0,
                max_sequence_length=SHAPES_MAX_SEQUENCE_LENGTH, true_cfg_scale=3.0,
            ),
            base_model=SHAPES_BASE,
            adapter_dir=shapes_adapter_dir(),
            latent_rgb=SHAPES_LATENT_RGB,
        ),
        BuiltinModel(
            name="tiny-flux",
            builder=_tiny_flux,
            # T5 prompt length: real FLUX uses 512; 32 keeps the joint attention sequence
            # short while still covering typical test prompts.
            defaults=ModelDefaults(
                width=64, height=64, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32
            ),
            base_model=FLUX_DEV,
        ),
        BuiltinModel(
            name="tiny-sdxl",
            builder=_tiny_sdxl,
            defaults=ModelDefaults(width=64, height=64, num_inference_steps=4, guidance_scale=5.0),
            base_model=SDXL_BASE,
        ),
        # The full-size random models exist to measure swaps and serving overheads on real layer
        # shapes, not to make 1024 px images on a CPU: small defaults. They only fit this machine's
        # memory in bf16, and they exist to measure bf16 serving, so bf16 even on CPU.
        BuiltinModel(
            name="random-flux",
            builder=_random_flux,
            defaults=ModelDefaults(
                width=128, height=128, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32
            ),
            base_model=FLUX_DEV,
            dtype="bfloat16",
            takes_layers=True,
            exportable=False,
        ),
        BuiltinModel(
            name="random-sdxl",
            builder=_random_sdxl,
            defaults=ModelDefaults(width=128, height=128, num_inference_steps=4, guidance_scale=5.0),
            base_model=SDXL_BASE,
            dtype="bfloat16",
            exportable=False,
        ),
        _tiny_family("tiny-qwen-image", QWEN_IMAGE, **_QWEN_IMAGE_GUIDANCE),
        _tiny_family("tiny-z-image", Z_IMAGE_TURBO, **_Z_IMAGE_TURBO_GUIDANCE),
        _tiny_family("tiny-flux2", FLUX2_DEV, **_FLUX2_DEV_GUIDANCE),
        _tiny_family("tiny-flux2-klein", FLUX2_KLEIN_4B, **_FLUX2_KLEIN_GUIDANCE),
        _random_family("random-qwen-image", QWEN_IMAGE, **_QWEN_IMAGE_GUIDANCE),
        _random_family("random-z-image", Z_IMAGE_TURBO, **_Z_IMAGE_TURBO_GUIDANCE),
        _random_family("random-flux2-klein", FLUX2_KLEIN_4B, **_FLUX2_KLEIN_GUIDANCE),
    )
}  # fmt: skip


def builtin_model(name: str) -> BuiltinModel:
    """The built-in model called `name`.

    Raises:
        ValueError: for a name that is not built in, listing those that are.
    """
    try:
        return BUILTINS[name]
    except KeyError:
        raise ValueError(f"unknown builtin model {name!r}; valid choices: {', '.join(BUILTINS)}") from None


def layers_refused(model: str) -> str:
    """The message for --layers given with a model that takes none."""
    *others, last = [name for name, builtin in BUILTINS.items() if builtin.takes_layers]
    layered = f"{', '.join(others)} and {last}" if others else last
    return f"--layers applies to {layered} only, not to {model!r}"


def _exportable() -> list[str]:
    return [name for name, builtin in BUILTINS.items() if builtin.exportable]
