"""What an adapter means, by diffusers itself: the reference the canonical-form tests compare against.

A fresh tiny pipeline that `load_lora_weights` a file gives, per PEFT layer,
`lora_B @ lora_A * scaling`; a canonical layer's `b @ a` must equal it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer

from loraswap.server.engine.adapters.formats import SlotSpec
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.startup import start_runtime

MAX_RANK = 16
DENOISER = {"tiny-flux": "transformer", "tiny-sdxl": "unet"}


def tiny_slot_specs() -> dict[str, SlotSpec]:
    """The slot spec of each real tiny runtime (default target modules, max rank 16, float32 on CPU, no fusing:
    what the slot itself takes)."""
    return {
        model: start_runtime(
            EngineConfig(model=model, max_rank=MAX_RANK, compile=False, warmup=False, torch_threads=1, fuse="never")
        ).slot_spec()
        for model in DENOISER
    }


@torch.no_grad()
def diffusers_deltas(model: str, path: Path) -> tuple[dict[str, torch.Tensor], object]:
    """Per-module `lora_B @ lora_A * scaling` after diffusers' own load_lora_weights on a fresh pipeline."""
    pipe = builtin_model(model).build()
    pipe.load_lora_weights(str(path))
    deltas = {}
    for name, module in getattr(pipe, DENOISER[model]).named_modules():
        if isinstance(module, LoraLayer):
            (adapter,) = module.lora_A.keys()
            deltas[name] = module.lora_B[adapter].weight @ module.lora_A[adapter].weight * module.scaling[adapter]
    return deltas, pipe


def canonical_deltas(adapter) -> dict[str, torch.Tensor]:
    return {name: layer.b.float() @ layer.a.float() for name, layer in adapter.layers.items()}


def change_deltas(adapter, spec, component: str) -> dict[str, torch.Tensor]:
    """The dense change of each of the adapter's layers of `component` outside the slot, as (out, in * k)."""
    deltas = {}
    for (owner, module), change in adapter.changes.items():
        if owner == component:
            shape = spec.model_layers.shape(component, module).weight
            deltas[module] = change.dense_delta(torch.device("cpu"), shape).reshape(shape[0], -1)
    return deltas


def kohya_text_encoder_mapping(spec, modules) -> dict[str, dict[str, list[tuple[str, slice]]]]:
    """component -> kohya_deltas mapping of kohya text-encoder modules (`lora_te1_…`, `lora_te2_…`), resolved by
    the model's own module paths."""
    mapping: dict[str, dict[str, list[tuple[str, slice]]]] = {}
    for kohya in modules:
        prefix, flat = kohya[: len("lora_te1")], kohya[len("lora_te1_") :]
        component = {"lora_te1": "text_encoder", "lora_te2": "text_encoder_2"}[prefix]
        module = spec.model_layers.by_flat_name(component, flat)
        mapping.setdefault(component, {})[kohya] = [(module, slice(None))]
    return mapping


def assert_same_deltas(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-6):
    assert actual.keys() == expected.keys()
    for name, delta in expected.items():
        torch.testing.assert_close(actual[name], delta, rtol=1e-5, atol=atol, msg=name)
