"""Pristine copies of base weights: each layer's W0, kept apart, that every fused merge starts from and every restore
writes back.

A merge never starts from a fused state and never subtracts a previous merge (diffusers' fuse/unfuse drifts in low
precision with every round trip): it reads W0 from here. The slot layers are copied at start-up, any other layer
before the first merge that touches it, within one budget (--fuse-memory-bytes). Each copy's largest value is read
with it, for the host's overflow bound (overflow_bounds.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from loraswap.server.engine.adapters.formats import ModelLayers
from loraswap.server.engine.adapters.residency.fp8_merges import is_float8_weight
from loraswap.server.engine.errors import AdapterTooLargeError, ErrorReason

LayerKey = tuple[str, str]  # (component, module path)


def _bytes_of(module: torch.nn.Module) -> int:
    """What a pristine copy of the layer takes: its weight and bias in the model's dtype, and a float8 weight's own
    data beside them (its element_size is the model dtype's)."""
    copied = sum(t.numel() * t.element_size() for t in (module.weight, module.bias) if t is not None)
    return copied + (module.weight.numel() if is_float8_weight(module.weight) else 0)


class PristineWeights:
    """A copy of base weights (and biases), on the model's device, each taken while its layer still held W0.

    `keep` copies layers now (the slot layers, at start-up); `cover` copies, before a merge, the layers it will
    touch that have none yet, within `budget_bytes` for all copies together (None: no limit). Each copy's largest
    value is read with it (one device read for all the layers copied together): merges bound their results with it.
    A layer already quantized to float8 when it is first copied keeps its float8 data and scale beside the values
    they stand for (a slot layer's copy is taken before --quantize, of the model's own dtype).
    """

    def __init__(
        self, model_layers: ModelLayers, keep: Iterable[LayerKey] = (), budget_bytes: int | None = None
    ) -> None:
        self.model_layers = model_layers
        self.budget_bytes = budget_bytes
        self.layers: dict[LayerKey, torch.nn.Module] = {}
        self.weights: dict[LayerKey, torch.Tensor] = {}
        self.biases: dict[LayerKey, torch.Tensor] = {}
        self.float8: dict[LayerKey, tuple[torch.Tensor, torch.Tensor]] = {}  # (qdata, scale) as quantized
        self._largest: dict[LayerKey, float] = {}  # max |W0| of each layer
        keep = list(keep)
        for key in keep:
            self._copy(key)
        self._measure(keep)

    def bytes_needed(self, keys: Iterable[LayerKey]) -> int:
        """What copies of these layers take, before taking them."""
        return sum(_bytes_of(self.model_layers.module(*key)) for key in set(keys))

    def _copy(self, key: LayerKey) -> None:
        layer = self.model_layers.module(*key)
        self.layers[key] = layer
        weight = layer.weight.detach()
        if is_float8_weight(weight):
            self.float8[key] = (weight.qdata.clone(), weight.scale.clone())
            self.weights[key] = weight.dequantize()
        else:
            self.weights[key] = weight.clone()
        if layer.bias is not None:
            self.biases[key] = layer.bias.detach().clone()

    def _measure(self, keys: Iterable[LayerKey]) -> None:
        """max |W0| of these layers, read from the device at once."""
        keys = [key for key in keys if key not in self._largest]
        if keys:
            largest = torch.stack([self.weights[key].abs().amax().float() for key in keys]).tolist()
            self._largest.update(zip(keys, largest))

    def cover(self, keys: Iterable[LayerKey]) -> None:
        """Copy the layers among `keys` that have no copy yet (they hold W0: no merge has touched them).

        Raises:
            AdapterTooLargeError: FUSE_MEMORY_EXCEEDED when the copies would pass the budget; nothing is copied.
        """
        missing = sorted(set(keys) - self.weights.keys())
        if not missing:
            return
        needed = self.bytes_needed(missing)
        if self.budget_bytes is not None and self.nbytes + needed > self.budget_bytes:
            raise AdapterTooLargeError(
                f"merging this stack first needs pristine copies of {len(missing)} more layer(s) ({needed} bytes) "
                f"beside the {self.nbytes} bytes kept, more than the {self.budget_bytes} bytes of --fuse-memory-bytes "
                "(or of what the device had free at start-up); raise --fuse-memory-bytes, or use adapters that "
                "change fewer layers",
                reason=ErrorReason.FUSE_MEMORY_EXCEEDED,
                needed_bytes=needed,
                budget_bytes=self.budget_bytes,
            )
        for key in missing:
            self._copy(key)
        self._measure(missing)

    def largest(self, key: LayerKey) -> float:
        """max |W0| of a layer, taken with its copy."""
        self._measure([key])
        return self._largest[key]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (*self.weights.values(), *self.biases.values()))

    def weight_bytes(self, keys: Iterable[LayerKey]) -> int:
        """Bytes of the named layers' base weights: what a merge into them reads and writes."""
        weights = (self.model_layers.module(*key).weight for key in keys)
        return sum(weight.numel() * weight.element_size() for weight in weights)
