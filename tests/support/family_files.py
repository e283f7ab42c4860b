"""Adapter files for Qwen-Image, Z-Image and FLUX.2 written by hand, in the layouts their trainers write, and the
ΔW each file means, made by hand: what a served image must equal where diffusers does not read the file.

A file layer is named as its layout spells it: a diffusers module path (`transformer_blocks.0.attn.to_q`) or an
original one (BFL's `double_blocks.0.img_attn.qkv`, Z-Image's `layers.0.attention.qkv`). It changes one or more
diffusers layers: a fused layer's rows go to its parts in order, each as wide as the part's own layer. ΔW of a file
layer is `up @ down`, times `alpha / rank` where the layout has an alpha; tests/unit/adapters/formats/
test_family_layouts.py checks the same meaning on tiny meta transformers against load_canonical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

# A layout: file layer -> (its down factor's key, its up factor's key, its alpha's key or None).
Layout = Callable[[str], tuple[str, str, str | None]]
WEIGHTS = "pytorch_lora_weights.safetensors"


def _flat(path: str) -> str:
    return path.replace(".", "_")


LAYOUTS: dict[str, Layout] = {
    # diffusers' own (and PEFT's, saved by diffusers): `transformer.` + module path, lora_A/lora_B, no alpha.
    "diffusers": lambda path: (f"transformer.{path}.lora_A.weight", f"transformer.{path}.lora_B.weight", None),
    # ComfyUI's: the module path under `diffusion_model.`, kohya's factor names and an alpha.
    "comfyui": lambda path: (f"diffusion_model.{path}.lora_down.weight", f"diffusion_model.{path}.lora_up.weight",
                             f"diffusion_model.{path}.alpha"),
    # ai-toolkit's: the module path under `diffusion_model.`, PEFT's factor names, no alpha.
    "ai-toolkit": lambda path: (f"diffusion_model.{path}.lora_A.weight", f"diffusion_model.{path}.lora_B.weight",
                                None),
    # DiffSynth-Studio's: the bare module path with PEFT's adapter name `default` left in.
    "diffsynth": lambda path: (f"{path}.lora_A.default.weight", f"{path}.lora_B.default.weight", None),
    # kohya's sd-scripts and musubi-tuner's: `lora_unet_` + the module path with underscores, and an alpha.
    "kohya": lambda path: (f"lora_unet_{_flat(path)}.lora_down.weight", f"lora_unet_{_flat(path)}.lora_up.weight",
                           f"lora_unet_{_flat(path)}.alpha"),
}  # fmt: skip


@dataclass(frozen=True)
class LayoutFile:
    """One hand-written file: its layout, the file layers it holds (file layer -> the diffusers layers its rows go to,
    in row order), and whether diffusers' own load_lora_weights reads it as it means (else the reference is the
    dense change merged by hand)."""

    layout: str
    layers: dict[str, tuple[str, ...]]
    diffusers_reads: bool


def whole(*modules: str) -> dict[str, tuple[str, ...]]:
    """File layers named by their one diffusers layer."""
    return {module: (module,) for module in modules}


def fused(file_layer: str, block: str, parts: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """One fused file layer whose rows are `block`'s `parts`, in this order."""
    return {file_layer: tuple(f"{block}.{part}" for part in parts)}


@dataclass(frozen=True)
class WrittenFile:
    """A file as written: its tensors by key, and each diffusers layer's ΔW at strength 1."""

    tensors: dict[str, torch.Tensor]
    deltas: dict[str, torch.Tensor]


def layout_tensors(spec: LayoutFile, denoiser: torch.nn.Module, *, rank: int, alpha: float, std: float,
                   seed: int) -> WrittenFile:  # fmt: skip
    """Random factors (N(0, std), `rank`) for every file layer of `spec`, at the widths of `denoiser`'s own layers,
    with `alpha` where the layout has one; and the ΔW the file means for each diffusers layer."""
    generator = torch.Generator().manual_seed(seed)
    keys = LAYOUTS[spec.layout]
    tensors, deltas = {}, {}
    for file_layer, parts in spec.layers.items():
        layers = [denoiser.get_submodule(part) for part in parts]
        in_features = layers[0].in_features
        assert all(layer.in_features == in_features for layer in layers), file_layer
        down = torch.randn(rank, in_features, generator=generator) * std
        up = torch.randn(sum(layer.out_features for layer in layers), rank, generator=generator) * std
        down_key, up_key, alpha_key = keys(file_layer)
        tensors[down_key], tensors[up_key] = down, up
        scale = 1.0
        if alpha_key is not None:
            tensors[alpha_key] = torch.tensor(alpha)
            scale = alpha / rank
        delta = up @ down * scale
        for part, rows in zip(parts, delta.split([layer.out_features for layer in layers]), strict=True):
            deltas[part] = rows.contiguous()
    return WrittenFile(tensors, deltas)


def save_adapter(tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    """`tensors` as an adapter folder (the one file diffusers' load_lora_weights and the server both look for)."""
    folder.mkdir(parents=True)
    save_file(tensors, folder / WEIGHTS)
    return folder / WEIGHTS
