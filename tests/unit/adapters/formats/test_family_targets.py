"""The layer names Qwen-Image, Z-Image and FLUX.2 files use, against the real module names of each full-size
transformer (family_models.FULL, built on the meta device): the family's default target modules, kohya's flat names
and ComfyUI's `diffusion_model.` names of every linear layer.
"""

from __future__ import annotations

import re

import pytest
import torch

from loraswap.server.engine.adapters.formats import comfy_as_kohya, file_layers, original_layer
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.types import ModelFamily
from tests.unit.adapters.formats.family_models import FULL, linear_layers, model


@pytest.mark.parametrize("name", sorted(FULL))
def test_every_default_target_module_names_linear_layers_of_the_model(name: str) -> None:
    family, transformer, layers = model(name)
    linears = linear_layers(layers)
    for pattern in FAMILIES[family].default_target_modules:
        matched = resolve_target_layers(transformer, (pattern,))  # raises when it matches no linear layer
        assert set(matched) <= set(linears), pattern
    targets = resolve_target_layers(transformer, FAMILIES[family].default_target_modules)
    assert all(isinstance(transformer.get_submodule(target), torch.nn.Linear) for target in targets)


@pytest.mark.parametrize("name", sorted(FULL))
def test_every_layer_has_a_kohya_name_of_its_own(name: str) -> None:
    """kohya writes '.' as '_': no two layers of the model may share that spelling, or a file layer would be
    ambiguous (ModelLayers.by_flat_name leaves such names unresolved)."""
    _, _, layers = model(name)
    modules = layers.shapes["transformer"]
    assert len({module.replace(".", "_") for module in modules}) == len(modules)
    assert all(layers.by_flat_name("transformer", module.replace(".", "_")) == module for module in modules)


@pytest.mark.parametrize("prefix", ["diffusion_model.", "base_model.model."])
@pytest.mark.parametrize("name", sorted(FULL))
def test_comfy_names_of_every_linear_layer_reach_it(name: str, prefix: str) -> None:
    """Every layer kohya can spell; Z-Image's per-patch-size layers (`all_x_embedder.2-1`) it cannot, and a file
    naming them goes to diffusers' converter whole (test_family_layouts.py)."""
    family, transformer, layers = model(name)
    linears = linear_layers(layers)
    unspellable = {module for module in linears if not re.fullmatch(r"[A-Za-z0-9_.]+", module)}
    assert unspellable == ({"all_x_embedder.2-1", "all_final_layer.2-1.linear", "all_final_layer.2-1.adaLN_modulation.1"}
                           if family == ModelFamily.Z_IMAGE else set())  # fmt: skip
    state = {f"{prefix}{module}.{factor}.weight": torch.empty(1, 1)
             for module in linears if module not in unspellable for factor in ("lora_A", "lora_B")}  # fmt: skip
    renamed, spellings = comfy_as_kohya(state, family)
    mapped = file_layers(
        renamed, FAMILIES[family].kohya_prefixes, layers,
        lambda flat: original_layer(family, flat, transformer.config), spellings,
    )  # fmt: skip
    assert {layer.module: layer.name for layer in mapped} == {m: prefix + m for m in linears if m not in unspellable}
    assert all(set(layer.tensors) == {"lora_down.weight", "lora_up.weight"} for layer in mapped)
