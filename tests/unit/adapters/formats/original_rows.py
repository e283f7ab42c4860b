"""An original model's layer names checked against diffusers' own single-file converter, row by row.

A checkpoint of the original model's linear layers is made whose every weight row holds its own global index; what
the converter makes of it says which original rows each diffusers weight is (splits and swaps included), an oracle
independent of adapters/formats/original_names.py. loraswap's reading of the same names as kohya-style layers
(`lora_unet_<name with '_' for '.'>`) must cut each original layer into the same diffusers layers and rows, and reach
every linear layer of the model exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from loraswap.server.engine.adapters.formats import ModelLayers, file_layers, original_layer
from loraswap.server.engine.types import ModelFamily
from tests.unit.adapters.formats.family_models import linear_layers


def converted_rows(
    linears: Mapping[str, tuple[int, int]], converter: Callable[[dict], dict], extra: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """diffusers module -> the global original row indices its weight holds; original layer -> its [start, stop).

    `extra`: tensors of the checkpoint that are no linear layer (norm scales), which the converter expects.
    """
    checkpoint, spans, start = {}, {}, 0
    for name, (rows, _) in linears.items():
        checkpoint[f"{name}.weight"] = torch.arange(start, start + rows, dtype=torch.float64).unsqueeze(1)
        spans[name] = (start, start + rows)
        start += rows
    converted = converter({**checkpoint, **extra})
    rows = {key.removesuffix(".weight"): value[:, 0] for key, value in converted.items()
            if key.endswith(".weight") and value.dim() == 2}  # fmt: skip
    return rows, spans


def assert_original_names_reach_the_converters_rows(
    family: ModelFamily,
    layers: ModelLayers,
    config: Mapping,
    linears: Mapping[str, tuple[int, int]],
    converted: Mapping[str, torch.Tensor],
    spans: Mapping[str, tuple[int, int]],
) -> None:
    """Each original layer, named kohya's way, cut into the rows the converter gives its diffusers layers; every
    linear layer of the model reached once, at its own width."""
    names = {f"lora_unet_{name.replace('.', '_')}": name for name in linears}
    state = {f"{flat}.lora_down.weight": torch.empty(1, 1) for flat in names}
    reached: dict[str, torch.Tensor] = {}
    mapped = file_layers(state, {"lora_unet": "transformer"}, layers, lambda flat: original_layer(family, flat, config))
    for layer in mapped:
        start, stop = spans[names[layer.name]]
        rows = torch.arange(start, stop, dtype=torch.float64)
        modules = [part.module for part in layer.parts] or [layer.module]
        assert {layers.shape("transformer", module).weight[1] for module in modules} == {linears[names[layer.name]][1]}
        if not layer.parts:
            assert layer.module not in reached, layer.module
            reached[layer.module] = rows
            continue
        assert layer.stacked_shape(layers).weight == (stop - start, linears[names[layer.name]][1]), layer.name
        for part in layer.parts:
            assert part.module not in reached, part.module
            reached[part.module] = torch.cat([rows[a:b] for a, b in part.rows])
    assert set(reached) == set(converted) == set(linear_layers(layers))  # every layer exactly once, as diffusers has it
    for module, rows in reached.items():
        assert torch.equal(rows, converted[module]), module
        assert layers.shape("transformer", module).weight[0] == rows.numel(), module
