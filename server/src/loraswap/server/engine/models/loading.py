"""What a --model value names: a built-in model (asked of the registry), else a diffusers folder or Hub id.

One pipeline loader, the generation defaults that fit the model, and the dtype it serves in
when --dtype is unset.
"""

from __future__ import annotations

import json
from pathlib import Path

from loraswap.server.engine.errors import StartupError, shorten
from loraswap.server.engine.families import family_of
from loraswap.server.engine.models.registry import BUILTINS, GENERATION_DEFAULTS_FILE, layers_refused
from loraswap.server.engine.types import LatentRgb, ModelDefaults


def load_pipeline(model: str, torch_dtype, layers: int | None = None):
    """A built-in model by name (tiny, trained or full-size random), or a diffusers folder / Hub id, on CPU.

    Raises:
        ValueError: for `layers` with a model that takes none (or out of its range).
        StartupError: for a name that is no built-in, no pipeline folder and no cached Hub id (one line).
    """
    builtin = BUILTINS.get(model)
    if builtin is not None:
        return builtin.build(torch_dtype, layers)
    if layers is not None:
        raise ValueError(layers_refused(model))
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(model, torch_dtype=torch_dtype)
    # diffusers says "no such folder or cached Hub id" with OSError, "no pipeline in this folder" with ValueError.
    except (OSError, ValueError) as error:
        cause = (str(error).splitlines() or [type(error).__name__])[0]
        raise StartupError(
            f"cannot load model {shorten(model, 200)!r}: it is no built-in model ({', '.join(BUILTINS)}), no diffusers "
            f"pipeline folder, and no Hub id in the local cache ({shorten(cause, 300)})"
        ) from error


def generation_defaults(model: str, pipe) -> ModelDefaults:
    """The built-in's defaults, a model folder's loraswap_generation.json, or the family's published ones."""
    builtin = BUILTINS.get(model)
    if builtin is not None:
        return builtin.defaults
    defaults_file = Path(model) / GENERATION_DEFAULTS_FILE
    if defaults_file.is_file():
        return ModelDefaults.from_dict(json.loads(defaults_file.read_text()))
    return family_of(pipe).published_defaults(pipe)


def model_name(model: str) -> str:
    """What to call `model` to callers (GetServerInfo.model): a built-in's or Hub id's own name; for a diffusers
    folder, the `_name_or_path` its model_index.json records (what it was saved from, where that is no absolute
    path), else the folder's name. Never this machine's paths."""
    folder = Path(model)
    if model in BUILTINS or not folder.is_dir():
        return model
    try:
        declared = json.loads((folder / "model_index.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        declared = None
    if isinstance(declared, str) and declared.strip() and not Path(declared).is_absolute():
        return declared.strip()
    return folder.resolve().name


def served_base_model(model: str) -> str:
    """The base model `model` serves, in the vocabulary adapters declare theirs (adapters/sources/base_model.py).

    A built-in model's registered base; a folder or a Hub id: its model_name.
    """
    builtin = BUILTINS.get(model)
    return builtin.base_model if builtin is not None else model_name(model)


def default_dtype(model: str, device_type: str) -> str:
    """The dtype `model` serves in on a `device_type` device when --dtype is unset."""
    builtin = BUILTINS.get(model)
    if builtin is not None and builtin.dtype is not None:
        return builtin.dtype
    return "bfloat16" if device_type == "cuda" else "float32"


def latent_rgb(model: str, pipe) -> LatentRgb:
    """The step previews' latent-to-RGB projection: the built-in's own, else the family's published one."""
    builtin = BUILTINS.get(model)
    if builtin is not None and builtin.latent_rgb is not None:
        return builtin.latent_rgb
    return family_of(pipe).latent_rgb
