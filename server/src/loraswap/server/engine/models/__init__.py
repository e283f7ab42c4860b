"""Model construction for the engine: the built-in models by name (registry.py), and what any --model names (loading.py).

Light to import: torch and diffusers load when a pipeline is built.
"""

from __future__ import annotations

from loraswap.server.engine.models.loading import (
    default_dtype,
    generation_defaults,
    latent_rgb,
    load_pipeline,
    model_name,
    served_base_model,
)
from loraswap.server.engine.models.registry import (
    BUILTINS,
    GENERATION_DEFAULTS_FILE,
    BuiltinModel,
    builtin_model,
    save_model_folder,
)

__all__ = [
    "BUILTINS",
    "GENERATION_DEFAULTS_FILE",
    "BuiltinModel",
    "builtin_model",
    "default_dtype",
    "generation_defaults",
    "latent_rgb",
    "load_pipeline",
    "model_name",
    "save_model_folder",
    "served_base_model",
]
