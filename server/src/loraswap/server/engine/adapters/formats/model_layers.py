"""Every weight of the resident model an adapter can change, per component: what adapter files are resolved
against and what a fused swap may merge into.

A component is a pipeline attribute (`unet` or `transformer`, `text_encoder`, `text_encoder_2`); its layers are
its linear and convolution modules, by module path, read before the swap slot wraps any of them (so a slot
layer is listed under its own path, not PEFT's `base_layer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# Leading module names one library version has and another not: transformers 5 builds CLIPTextModel without the
# `text_model` wrapper its 4.x versions (and so every published file) name, CLIPTextModelWithProjection with it.
OPTIONAL_PREFIXES = ("text_model.",)
# The module types whose weight a merge writes: a weight of (out, in, *kernel) and an optional bias of (out,).
MERGEABLE_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass(frozen=True)
class LayerShape:
    """A mergeable layer's weight shape and whether it has a bias."""

    weight: tuple[int, ...]
    has_bias: bool

    @property
    def out_features(self) -> int:
        return self.weight[0]


@dataclass(frozen=True)
class ModelLayers:
    """Component -> module path -> shape, for every mergeable layer; `modules` holds the layers themselves (empty
    in a copy made for a test or a thread that only resolves names)."""

    shapes: Mapping[str, Mapping[str, LayerShape]]
    modules: Mapping[tuple[str, str], torch.nn.Module] = field(default_factory=dict, compare=False, repr=False)
    # Each component's module paths with '_' for '.', as kohya and LyCORIS name layers; ambiguous ones left out.
    _flat: dict[str, dict[str, str]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for component, layers in self.shapes.items():
            flat: dict[str, str | None] = {}
            for module in layers:
                key = module.replace(".", "_")
                flat[key] = None if key in flat else module
            self._flat[component] = {key: module for key, module in flat.items() if module is not None}

    @classmethod
    def of(cls, components: Mapping[str, torch.nn.Module]) -> ModelLayers:
        """The mergeable layers of these components (attribute name -> module)."""
        shapes: dict[str, dict[str, LayerShape]] = {}
        modules: dict[tuple[str, str], torch.nn.Module] = {}
        for component, root in components.items():
            layers = shapes.setdefault(component, {})
            for name, module in root.named_modules():
                if isinstance(module, MERGEABLE_MODULES) and isinstance(module.weight, torch.nn.Parameter):
                    layers[name] = LayerShape(tuple(module.weight.shape), module.bias is not None)
                    modules[component, name] = module
        return cls(shapes, modules)

    @classmethod
    def of_layers(cls, component: str, layers: Mapping[str, torch.nn.Module]) -> ModelLayers:
        """These layers (module path -> layer) alone, as one component's."""
        shapes = {name: LayerShape(tuple(layer.weight.shape), layer.bias is not None) for name, layer in layers.items()}
        return cls({component: shapes}, {(component, name): layer for name, layer in layers.items()})

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self.shapes)

    def shape(self, component: str, module: str) -> LayerShape | None:
        return self.shapes.get(component, {}).get(module)

    def resolve(self, component: str, module: str) -> str | None:
        """The module path of this component that `module` names, with or without an OPTIONAL_PREFIXES wrapper;
        None when it names no mergeable layer."""
        layers = self.shapes.get(component, {})
        for candidate in _spellings(module, OPTIONAL_PREFIXES):
            if candidate in layers:
                return candidate
        return None

    def by_flat_name(self, component: str, flat: str) -> str | None:
        """The module path whose kohya spelling ('.' as '_') is `flat`, with or without an OPTIONAL_PREFIXES
        wrapper; None when no layer (or more than one) has it."""
        flat_names = self._flat.get(component, {})
        for candidate in _spellings(flat, tuple(prefix.replace(".", "_") for prefix in OPTIONAL_PREFIXES)):
            if candidate in flat_names:
                return flat_names[candidate]
        return None

    def module(self, component: str, module: str) -> torch.nn.Module:
        return self.modules[component, module]


def _spellings(name: str, prefixes: tuple[str, ...]) -> list[str]:
    """`name` itself first, then without or with each optional prefix."""
    spellings = [name]
    for prefix in prefixes:
        spellings.append(name.removeprefix(prefix) if name.startswith(prefix) else prefix + name)
    return spellings
