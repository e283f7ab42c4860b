"""load_canonical: an adapter file read into its canonical form (canonical_adapter.py), once, before any use.

The file itself is read by safetensors_file.py and its LoraConfig checked by lora_config.py, both as untrusted input.
Each part of the file goes to its layout's reader: kohya-style names (sd-scripts and LyCORIS names with the family's
`kohya_prefixes`; for the newer families also ComfyUI's and ai-toolkit's `diffusion_model.` names, which spell them:
comfy_names.py) to kohya_layout.py, which reads every kind against the model's own module paths; every other
layout to diffusers_layout.py, through diffusers' own converters, so such an adapter means exactly what diffusers
makes of it. The text-encoder parts of a file for a family diffusers loads no text-encoder LoRA for are set apart
before either reader (text_encoder_parts.py). The server's settings then decide what is kept and what only a fused
swap applies (admission.py), and how far the adapter moves each layer is measured and checked in range
(change_effects.py).
"""

from __future__ import annotations

import time

from loraswap.server.engine.adapters.formats.admission import (
    ReadAdapter,
    SlotSpec,
    admit,
    admit_text_encoder_layers,
    fits_slot,
)
from loraswap.server.engine.adapters.formats.canonical_adapter import CanonicalAdapter
from loraswap.server.engine.adapters.formats.change_effects import (
    formed_on_the_way,
    layer_effect,
    refuse_out_of_range,
    slot_effect,
)
from loraswap.server.engine.adapters.formats.comfy_names import comfy_as_kohya
from loraswap.server.engine.adapters.formats.diffusers_layout import read_other_layout
from loraswap.server.engine.adapters.formats.key_layouts import kohya_style_keys, refuse_unsupported_kinds
from loraswap.server.engine.adapters.formats.kohya_layout import read_kohya_layout
from loraswap.server.engine.adapters.formats.tensor_checks import check_tensors
from loraswap.server.engine.adapters.formats.text_encoder_parts import set_apart_text_encoders
from loraswap.server.engine.adapters.sources import AdapterFile, BaseModelPolicy, read_adapter_file
from loraswap.server.engine.errors import AdapterFormatError, shorten
from loraswap.server.engine.families import FAMILIES


def _effects(read: ReadAdapter, spec: SlotSpec) -> dict[tuple[str, str], float]:
    """How far the adapter moves each layer at strength 1 (change_effects.py)."""
    effects = {
        (spec.denoiser, module): slot_effect(layer.a, layer.b, layer.magnitude, layer.bias, spec.dtype)
        for module, layer in read.layers.items()
    }
    for (component, module), change in read.changes.items():
        shape = spec.model_layers.shape(component, module)
        effects[component, module] = layer_effect(change, shape.weight, spec.dtype)
    return effects


def load_canonical(
    adapter_file: AdapterFile, spec: SlotSpec, base_models: BaseModelPolicy | None = None
) -> CanonicalAdapter:
    """Read, convert and validate an adapter file into its canonical form; touches no model.

    With `base_models`, an adapter declaring another base is refused first, from its header and card alone.
    """
    started = time.perf_counter()
    if base_models is not None:
        base_models.check(adapter_file)
    raw, metadata = read_adapter_file(adapter_file)
    if not raw:
        raise AdapterFormatError(f"adapter {shorten(adapter_file.name)!r} holds no tensors")
    raw, unread_encoders = set_apart_text_encoders(raw, spec.family, spec.denoiser)
    # Before the file is read: a refusal of the text-encoder parts costs no conversion.
    encoders_dropped = admit_text_encoder_layers(unread_encoders, "tensors", spec) if unread_encoders else None
    raw, spellings = comfy_as_kohya(raw, spec.family)
    kohya_keys = kohya_style_keys(raw, FAMILIES[spec.family].kohya_prefixes)
    refuse_unsupported_kinds({key: raw[key] for key in kohya_keys})  # first: a kind's own tensors may be scalars
    check_tensors(raw)
    read = read_kohya_layout({key: raw[key] for key in kohya_keys}, spec, spellings) if kohya_keys else None
    others = {key: value for key, value in raw.items() if key not in kohya_keys}
    if others:  # another layout
        read = read_other_layout(others, metadata, spec).joined(read)
    if encoders_dropped is not None:
        read.warnings.append(encoders_dropped)
    admit(read, spec)
    effects = _effects(read, spec)
    on_the_way = {key: formed_on_the_way(change) for key, change in read.changes.items()}
    refuse_out_of_range(effects, spec.dtype, on_the_way)
    return CanonicalAdapter(
        name=adapter_file.name,
        source=adapter_file.source,
        layers=read.layers,
        warnings=tuple(read.warnings),
        load_ms=(time.perf_counter() - started) * 1000.0,
        fits_slot=fits_slot(read.layers, read.changes, spec),
        changes=read.changes,
        effects=effects,
        download_ms=adapter_file.download_ms,
        download_bytes=adapter_file.download_bytes,
    )
