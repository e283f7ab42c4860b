"""The hot set of --device-adapter-bytes, with CPU tensors standing in for the device's.

DeviceAdapterCache does nothing CUDA-specific: it copies an adapter's copy sources to a device, keeps them under a
byte budget least recently used out first, and forgets adapters that are gone. The server turns it on for CUDA
only; its bookkeeping, and that a slot copying from it holds exactly what a slot copying from the host holds, are
checked here on the CPU. What only a GPU shows (pinned memory, the side stream, device-to-device speed) is in
benchmarks/gpu_check.sh's run.
"""

from __future__ import annotations

import gc

import pytest
import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer
from loraswap.server.engine.adapters.residency import CopyStream, DeviceAdapterCache
from loraswap.server.engine.families import FLUX
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from tests.support.slots import install_residency

torch.set_num_threads(1)

CPU = torch.device("cpu")


def _adapter(name: str, rank: int = 4, seed: int = 0) -> tuple[CanonicalAdapter, list[torch.Tensor]]:
    """A one-layer adapter and the copy sources a slot would hand the hot set for it."""
    generator = torch.Generator().manual_seed(seed)
    layer = CanonicalLayer(a=torch.randn(rank, 32, generator=generator), b=torch.randn(48, rank, generator=generator))
    adapter = CanonicalAdapter(name=name, source="test", layers={"layer": layer}, warnings=(), load_ms=0.0)
    return adapter, [layer.a, layer.b]


def test_copies_are_made_once_and_are_equal_copies():
    cache = DeviceAdapterCache(10_000, CPU)
    adapter, host = _adapter("a")
    copies = cache.sources(adapter, host)
    assert [torch.equal(copy, source) for copy, source in zip(copies, host)] == [True, True]
    assert all(copy.data_ptr() != source.data_ptr() for copy, source in zip(copies, host))
    assert cache.sources(adapter, host) is copies  # the second swap copies from the same device tensors
    assert (cache.hits, cache.misses, cache.used_bytes) == (1, 1, adapter.nbytes)


def test_least_recently_swapped_leaves_first_within_the_budget():
    (a, a_host), (b, b_host), (c, c_host) = (_adapter(name, seed=seed) for seed, name in enumerate("abc"))
    cache = DeviceAdapterCache(2 * a.nbytes, CPU)  # room for two
    cache.sources(a, a_host)
    cache.sources(b, b_host)
    cache.sources(a, a_host)  # a is now the most recently used
    cache.sources(c, c_host)  # b makes room
    assert (cache.holds(a), cache.holds(b), cache.holds(c)) == (True, False, True)
    assert cache.used_bytes == 2 * a.nbytes <= cache.budget_bytes
    assert (cache.hits, cache.misses) == (1, 3)


def test_an_adapter_larger_than_the_budget_is_copied_from_the_host():
    adapter, host = _adapter("big", rank=8)
    cache = DeviceAdapterCache(adapter.nbytes - 1, CPU)
    assert cache.sources(adapter, host) is host
    assert len(cache) == 0 and not cache.holds(adapter)
    assert DeviceAdapterCache(0, CPU).sources(adapter, host) is host  # no budget: no hot set


def test_an_adapter_that_is_gone_leaves_the_hot_set():
    cache = DeviceAdapterCache(10_000, CPU)
    adapter, host = _adapter("a")
    cache.sources(adapter, host)
    assert cache.used_bytes == adapter.nbytes
    del adapter, host
    gc.collect()
    assert len(cache) == 0 and cache.used_bytes == 0  # an evicted adapter's device copies are not kept alive


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="negative"):
        DeviceAdapterCache(-1, CPU)


def test_a_slot_copying_from_the_hot_set_holds_what_a_slot_copying_from_the_host_holds():
    def slot_and_layers(device_cache=None):
        transformer = builtin_model("tiny-flux").build().transformer.to(torch.bfloat16)
        layers = resolve_target_layers(transformer, FLUX.default_target_modules)
        residency = install_residency(transformer, layers, 16, torch.bfloat16, device_cache=device_cache)
        return residency, transformer, layers

    plain, plain_model, layers = slot_and_layers()
    hot, hot_model, _ = slot_and_layers(DeviceAdapterCache(1 << 30, CPU))
    generator = torch.Generator().manual_seed(0)
    adapters = []
    for name, rank in (("r8", 8), ("r3", 3)):  # 16 bytes a lora_B row, and 6 (element by element)
        layer_factors = {}
        for layer in layers:
            base = plain_model.get_submodule(layer).base_layer
            layer_factors[layer] = CanonicalLayer(
                a=torch.randn(rank, base.in_features, generator=generator).to(torch.bfloat16),
                b=torch.randn(base.out_features, rank, generator=generator).to(torch.bfloat16),
            )
        adapters.append(CanonicalAdapter(name=name, source="test", layers=layer_factors, warnings=(), load_ms=0.0))
    r8, r3 = adapters
    for members in [((r8, 0.5),), ((r3, 1.0), (r8, 1.0)), ((r8, 0.5),), ((r3, -2.0),)]:
        plain.load_stack(members)
        hot.load_stack(members)
        for name, tensor in plain_model.state_dict().items():
            if "lora_" in name:
                assert torch.equal(hot_model.state_dict()[name], tensor), name
    assert hot.device_cache.hits == 3 and hot.device_cache.misses == 2


def test_off_cuda_copies_run_in_place():
    assert not CopyStream(CPU).active and not CopyStream(None).active
    with CopyStream(CPU).copying():
        pass
