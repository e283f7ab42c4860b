"""The BFL (original Flux) layer names sd-scripts and LyCORIS write, mapped to full-size FLUX.1's diffusers layers.

The BFL names are generated here from BFL's own model structure (flux/model.py at FLUX.1-dev's settings: img_in,
time_in, vector_in, guidance_in, txt_in, 19 double blocks, 38 single blocks, final_layer). A BFL checkpoint of
those names is put through diffusers' own single-file converter (`convert_flux_transformer_checkpoint_to_diffusers`,
what `from_single_file` loads BFL checkpoints with), an oracle independent of adapters/formats/original_names.py: its rows
hold their own global index, so the converter's output says which BFL rows each diffusers weight is, splits and
swaps included. loraswap's mapping must cut each BFL layer into the same diffusers layers and rows, and reach
every linear layer of a meta-device full-size FLUX.1 transformer exactly once.
"""

from __future__ import annotations

import torch

from loraswap.server.engine.adapters.formats import ModelLayers, bfl_to_diffusers, file_layers
from loraswap.server.engine.models.random_full import FLUX_TRANSFORMER_CONFIG

HIDDEN, MLP, CONTEXT, POOLED, TIME, CHANNELS = 3072, 4 * 3072, 4096, 768, 256, 64
DOUBLE, SINGLE = 19, 38


def _embedder(name: str, width: int) -> dict[str, tuple[int, int]]:
    return {f"{name}.in_layer": (HIDDEN, width), f"{name}.out_layer": (HIDDEN, HIDDEN)}


def bfl_linears() -> dict[str, tuple[int, int]]:
    """Every linear layer of BFL's FLUX.1-dev by its module path: (out, in)."""
    layers = {"img_in": (HIDDEN, CHANNELS), "txt_in": (HIDDEN, CONTEXT), **_embedder("time_in", TIME),
              **_embedder("vector_in", POOLED), **_embedder("guidance_in", TIME)}  # fmt: skip
    for i in range(DOUBLE):
        for stream in ("img", "txt"):
            block = f"double_blocks.{i}.{stream}"
            layers |= {f"{block}_mod.lin": (6 * HIDDEN, HIDDEN), f"{block}_attn.qkv": (3 * HIDDEN, HIDDEN),
                       f"{block}_attn.proj": (HIDDEN, HIDDEN), f"{block}_mlp.0": (MLP, HIDDEN),
                       f"{block}_mlp.2": (HIDDEN, MLP)}  # fmt: skip
    for i in range(SINGLE):
        layers |= {f"single_blocks.{i}.linear1": (3 * HIDDEN + MLP, HIDDEN),
                   f"single_blocks.{i}.linear2": (HIDDEN, HIDDEN + MLP),
                   f"single_blocks.{i}.modulation.lin": (3 * HIDDEN, HIDDEN)}  # fmt: skip
    return layers | {"final_layer.linear": (CHANNELS, HIDDEN), "final_layer.adaLN_modulation.1": (2 * HIDDEN, HIDDEN)}


def bfl_norm_scales() -> list[str]:
    """The QK-norm scales of every block: not layers a merge reaches, but part of a BFL checkpoint."""
    norms = [f"double_blocks.{i}.{s}_attn.norm.{n}_norm.scale" for i in range(DOUBLE) for s in ("img", "txt")
             for n in ("query", "key")]  # fmt: skip
    return norms + [f"single_blocks.{i}.norm.{n}_norm.scale" for i in range(SINGLE) for n in ("query", "key")]


def _converted_rows() -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """diffusers module -> the global BFL row indices its weight holds; BFL layer -> its global [start, stop)."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    checkpoint, spans, start = {}, {}, 0
    for name, (rows, _) in bfl_linears().items():
        ids = torch.arange(start, start + rows, dtype=torch.float64)
        checkpoint[f"{name}.weight"] = ids.unsqueeze(1)
        checkpoint[f"{name}.bias"] = ids.clone()
        spans[name] = (start, start + rows)
        start += rows
    checkpoint |= {name: torch.ones(128) for name in bfl_norm_scales()}
    converted = convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    assert not checkpoint, f"BFL names the converter did not take: {sorted(checkpoint)[:5]}"
    return {key.removesuffix(".weight"): value[:, 0] for key, value in converted.items()
            if key.endswith(".weight") and value.dim() == 2}, spans  # fmt: skip


def _full_size_layers() -> ModelLayers:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FLUX_TRANSFORMER_CONFIG)
    return ModelLayers.of({"transformer": transformer})


def test_every_bfl_layer_maps_to_the_rows_diffusers_single_file_converter_gives() -> None:
    converted, spans = _converted_rows()
    model = _full_size_layers()
    names = {f"lora_unet_{name.replace('.', '_')}": name for name in bfl_linears()}
    state = {f"{flat}.lora_down.weight": torch.empty(1, 1) for flat in names}
    reached: dict[str, torch.Tensor] = {}
    for layer in file_layers(state, {"lora_unet": "transformer"}, model, bfl_to_diffusers):
        start, stop = spans[names[layer.name]]
        rows = torch.arange(start, stop, dtype=torch.float64)
        if not layer.parts:
            assert layer.module not in reached
            reached[layer.module] = rows
            continue
        assert layer.stacked_shape(model).weight == (stop - start, bfl_linears()[names[layer.name]][1])
        for part in layer.parts:
            assert part.module not in reached
            reached[part.module] = torch.cat([rows[a:b] for a, b in part.rows])
    linear_layers = {module for module, shape in model.shapes["transformer"].items() if len(shape.weight) == 2}
    assert set(reached) == set(converted) == linear_layers  # every layer exactly once, as diffusers has it
    for module, rows in reached.items():
        assert torch.equal(rows, converted[module]), module
        assert model.shape("transformer", module).weight[0] == rows.numel(), module
