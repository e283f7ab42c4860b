"""Model construction for the engine (builtin tiny pipelines)."""

from loraswap.engine.models.tiny import (
    BUILTIN_MODELS,
    GENERATION_DEFAULTS_FILE,
    TINY_FLUX_MAX_SEQUENCE_LENGTH,
    TINY_SIZE_MULTIPLE,
    build_builtin_pipeline,
    builtin_defaults,
    export_builtin_model,
)

__all__ = [
    "BUILTIN_MODELS",
    "GENERATION_DEFAULTS_FILE",
    "TINY_FLUX_MAX_SEQUENCE_LENGTH",
    "TINY_SIZE_MULTIPLE",
    "build_builtin_pipeline",
    "builtin_defaults",
    "export_builtin_model",
]
