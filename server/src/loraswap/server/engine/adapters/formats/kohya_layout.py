"""The kohya/LyCORIS-layout reader: a kohya-style file (sd-scripts and LyCORIS names), every kind.

Its layer names (`<prefix>_<module path>` with the family's `kohya_prefixes`) are resolved against the model's own
module paths (key_layouts.py; sgm SDXL, BFL Flux and FLUX.2 and Z-Image's original names by original_names.py) and
its layers read kind by kind (lycoris_layers.py). For the newer families, ComfyUI's and ai-toolkit's
`diffusion_model.` files come here too, renamed to the kohya-style names they spell (comfy_names.py). The admission
rules (admission.py) send plain LoRAs of slot layers to the slot; every other layer is a change. A model layer two
file layers change (a fused original layer beside one of its parts, one layer in two spellings or prefixes) is
refused, in every family's files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loraswap.server.engine.adapters.formats.admission import ReadAdapter, SlotSpec, slot_layer, slot_lora
from loraswap.server.engine.adapters.formats.key_layouts import file_layers, refuse_layers_twice
from loraswap.server.engine.adapters.formats.lycoris_layers import read_layers
from loraswap.server.engine.adapters.formats.original_names import original_layer
from loraswap.server.engine.families import FAMILIES


def read_kohya_layout(
    raw: dict[str, torch.Tensor], spec: SlotSpec, spellings: Mapping[str, str] | None = None
) -> ReadAdapter:
    """A kohya-style file (sd-scripts, LyCORIS), every kind, resolved against the model's own layers: plain LoRAs
    of slot layers go to the slot, the rest are changes. `spellings`: the file's own names of layers renamed to
    kohya-style ones (comfy_names.py), for messages. A file that changes a layer twice is refused."""
    layers = file_layers(
        raw, FAMILIES[spec.family].kohya_prefixes, spec.model_layers,
        lambda flat: original_layer(spec.family, flat, spec.denoiser_config), spellings,
    )  # fmt: skip
    # Whatever the family: below, a second change of one layer would replace the first unseen.
    refuse_layers_twice(layers)
    read = ReadAdapter(layers={}, changes={})
    for layer in read_layers(layers, spec.model_layers, pin_memory=spec.pin_memory):
        if (low_rank := slot_lora(layer, spec)) is not None:
            read.layers[layer.module] = slot_layer(
                layer.module, low_rank.down, low_rank.up, low_rank.scale, spec,
                (f"{layer.module} lora_down", f"{layer.module} lora_up"),
            )  # fmt: skip
        else:
            read.changes[layer.component, layer.module] = layer.change
    return read
