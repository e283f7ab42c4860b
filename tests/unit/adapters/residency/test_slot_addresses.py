"""Swaps write into the same tensors: what CUDA graphs (--compile-mode reduce-overhead) need to stay valid.

A captured CUDA graph replays kernels on fixed addresses. Here every parameter and buffer of a denoiser with the
swap slot installed (the base weights, each layer's lora_A and lora_B, the rank gates, and anything the slot may
add) is recorded by address before a sequence of swaps: single adapters of several ranks and strengths, one that
covers fewer layers, one of an odd rank (copied off the 16-byte path), stacks, the base model, across rank
buckets, with and without the hot set of device copies. After every swap each address, shape and stride must be
what it was, while the slot's contents did change.
"""

from __future__ import annotations

import pytest
import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer
from loraswap.server.engine.adapters.residency import DeviceAdapterCache
from loraswap.server.engine.families import FLUX
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from tests.support.slots import gates_match_resident, install_residency

torch.set_num_threads(1)

MAX_RANK = 16
DTYPE = torch.bfloat16


def _adapter(transformer, layers, name: str, rank: int, seed: int) -> CanonicalAdapter:
    generator = torch.Generator().manual_seed(seed)
    canonical = {}
    for layer in layers:
        base = transformer.get_submodule(layer).base_layer
        a = torch.randn(rank, base.in_features, generator=generator) * 0.1
        b = torch.randn(base.out_features, rank, generator=generator) * 0.1
        canonical[layer] = CanonicalLayer(a=a.to(DTYPE), b=b.to(DTYPE))
    return CanonicalAdapter(name=name, source="test", layers=canonical, warnings=(), load_ms=0.0)


def _addresses(transformer) -> dict[str, tuple]:
    tensors = {f"param {name}": tensor for name, tensor in transformer.named_parameters()}
    tensors |= {f"buffer {name}": tensor for name, tensor in transformer.named_buffers()}
    return {name: (tensor.data_ptr(), tuple(tensor.shape), tensor.stride()) for name, tensor in tensors.items()}


@pytest.mark.parametrize("hot_set", [False, True], ids=["host-copies", "hot-set"])
def test_every_swap_writes_into_the_same_tensors(hot_set):
    transformer = builtin_model("tiny-flux").build().transformer.to(DTYPE)
    layers = resolve_target_layers(transformer, FLUX.default_target_modules)
    # CPU tensors stand in for the device's: with a hot set the slot copies from its copies, not the adapters'.
    device_cache = DeviceAdapterCache(1 << 30, torch.device("cpu")) if hot_set else None
    slot = install_residency(transformer, layers, MAX_RANK, DTYPE, (4, 8, MAX_RANK), device_cache=device_cache)
    recorded = _addresses(transformer)
    factors = [name for name in recorded if name.startswith("param ") and (".lora_A." in name or ".lora_B." in name)]
    assert len(factors) == 2 * len(layers)
    assert sum(name.endswith(".rank_gate") for name in recorded) == len(layers)
    before = _addresses(transformer)

    r16 = _adapter(transformer, layers, "r16", 16, seed=1)
    r4 = _adapter(transformer, layers, "r4", 4, seed=2)
    r8 = _adapter(transformer, layers, "r8", 8, seed=3)
    odd = _adapter(transformer, layers, "odd", 3, seed=4)
    partial = CanonicalAdapter(
        name="partial", source="test", layers={layers[0]: r8.layers[layers[0]]}, warnings=(), load_ms=0.0
    )
    sequence = [
        ((r16, 1.0),), ((r4, 0.5),), ((r4, 0.5), (r8, 1.0)), (), ((partial, 1.0),), ((odd, -1.5),),
        ((r8, 2.0), (r4, 1.0), (odd, 1.0)), ((r16, 1.0),), ((r4, 1.0),), (), ((r8, 1.0), (r4, 0.5)),
    ]  # fmt: skip
    first_layer = transformer.get_submodule(layers[0])
    buckets = set()
    for members in sequence:
        lora_b = first_layer.lora_B["loraswap_slot"].weight.clone()
        gate = first_layer.lora_A["loraswap_slot"].rank_gate.clone()
        slot.load_stack(members)
        assert _addresses(transformer) == before, f"a swap to {[a.name for a, _ in members]} moved a tensor"
        assert gates_match_resident(slot.slot)
        changed = not torch.equal(first_layer.lora_B["loraswap_slot"].weight, lora_b) or not torch.equal(
            first_layer.lora_A["loraswap_slot"].rank_gate, gate
        )
        assert changed, f"the swap to {[a.name for a, _ in members]} wrote nothing"
        buckets.add(slot.bucket)
    assert buckets == {0, 4, 8, MAX_RANK}  # every graph the slot computes with was swapped into
    if hot_set:
        assert slot.device_cache.hits > 0 and len(slot.device_cache) == 5
