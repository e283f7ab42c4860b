"""Swap slots on real denoisers outside a server, and the invariants tests check them against."""

from __future__ import annotations

import torch

from loraswap.server.engine.adapters.residency import AdapterResidency, DeviceAdapterCache, FusedWeights, HotswapSlot

CPU = torch.device("cpu")
DENOISER = "denoiser"  # the component name the residencies made here give their denoiser


def install_residency(
    denoiser: torch.nn.Module,
    layers: list[str],
    max_rank: int,
    dtype: torch.dtype,
    rank_buckets: tuple[int, ...] | None = None,
    *,
    fuse: bool = False,
    device_cache: DeviceAdapterCache | None = None,
) -> AdapterResidency:
    """The slot installed on `layers` of a CPU denoiser, with pristine copies to fuse from when `fuse`."""
    slot = HotswapSlot.install(denoiser, layers, max_rank, dtype, CPU, rank_buckets)
    fused = FusedWeights.over_layers(DENOISER, slot.base_layers()) if fuse else None
    return AdapterResidency(slot, fused, device_cache)


def gates_match_resident(slot: HotswapSlot) -> bool:
    """Each layer's gate opens exactly its resident ranks, and every slot weight is finite."""
    return all(
        torch.equal(live.gate, slot.gate_rows[live.resident_rank])
        and bool(torch.isfinite(live.a).all())
        and bool(torch.isfinite(live.b).all())
        for live in slot.layers.values()
    )


def holds_pristine(fused: FusedWeights) -> bool:
    """Every base weight and bias equals its pristine copy bit for bit."""
    pristine = fused.pristine
    return all(
        torch.equal(layer.weight, pristine.weights[name])
        and (layer.bias is None or torch.equal(layer.bias, pristine.biases[name]))
        for name, layer in pristine.layers.items()
    )
