"""Formats: what an adapter file means, read from its bytes into weight changes.

Key layouts (diffusers/PEFT, kohya, ComfyUI, BFL, SGM and Z-Image's original names) and a reader for each,
LoraConfig scalings, every LyCORIS kind and the weight change each makes, what the swap slot admits and what only a
fused swap applies, how far each change moves its layer, and the canonical adapter every reader's output becomes
(load_canonical).

May import: sources/ (files and their claims) and the engine's leaves. Knows no slot and no model weights beyond
layer names and shapes (ModelLayers); writes nothing into the model (residency/ does). Other code uses the names
below, never a module inside.
"""

from __future__ import annotations

from loraswap.server.engine.adapters.formats.admission import (
    SlotSpec,
)
from loraswap.server.engine.adapters.formats.canonical import (
    load_canonical,
)
from loraswap.server.engine.adapters.formats.canonical_adapter import (
    CanonicalAdapter,
    CanonicalLayer,
    StackMember,
)
from loraswap.server.engine.adapters.formats.change_effects import (
    effect_limit,
    formed_on_the_way,
    largest_fitting_strength,
    layer_effect,
    refuse_out_of_range,
    refuse_strengths,
    slot_effect,
)
from loraswap.server.engine.adapters.formats.change_kinds import (
    Full,
    Hadamard,
    Kronecker,
    LowRank,
)
from loraswap.server.engine.adapters.formats.comfy_names import (
    comfy_as_kohya,
)
from loraswap.server.engine.adapters.formats.diffusers_keys import (
    normalised_keys,
)
from loraswap.server.engine.adapters.formats.diffusers_layout import (
    converter_said,
)
from loraswap.server.engine.adapters.formats.key_layouts import (
    file_layers,
)
from loraswap.server.engine.adapters.formats.model_layers import (
    ModelLayers,
)
from loraswap.server.engine.adapters.formats.original_names import (
    bfl_to_diffusers,
    original_layer,
    sgm_to_diffusers,
)
from loraswap.server.engine.adapters.formats.text_encoder_parts import (
    text_encoder_of,
)
from loraswap.server.engine.adapters.formats.weight_changes import (
    LayerChange,
)

__all__ = [
    "CanonicalAdapter",
    "CanonicalLayer",
    "Full",
    "Hadamard",
    "Kronecker",
    "LayerChange",
    "LowRank",
    "ModelLayers",
    "SlotSpec",
    "StackMember",
    "bfl_to_diffusers",
    "comfy_as_kohya",
    "converter_said",
    "effect_limit",
    "file_layers",
    "formed_on_the_way",
    "largest_fitting_strength",
    "layer_effect",
    "load_canonical",
    "normalised_keys",
    "original_layer",
    "refuse_out_of_range",
    "refuse_strengths",
    "sgm_to_diffusers",
    "slot_effect",
    "text_encoder_of",
]
