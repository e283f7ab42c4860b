"""Fused swaps: the resident adapters merged into the base weights of the layers they touch, exactly.

With an adapter fused, each layer it changes holds W0 + sum_i s_i * B_i A_i in its own base weight
(the very tensor the compiled graphs read, so addresses and CUDA graphs stay valid) and the LoRA
branch is skipped as for the base model: a step costs what the base model's does.

Exact by construction, whatever ran before:
- every merge starts from the layer's pristine W0, a copy kept apart (`PristineWeights`, pristine_weights.py: the
  slot layers' at start-up, any other layer's before the first merge that touches it), never from a fused state and
  never by subtracting a previous merge (diffusers' fuse/unfuse drifts in low precision with every round trip);
- the sum is accumulated in float32 and rounded once to the model's dtype: for a layer that only plain LoRAs at
  one alpha change, or one LoHa or LoKr alone, straight into the weight in its own dtype, on the CPU and on a GPU
  alike (own_dtype_merges.py: bfloat16 and float32 products and pointwise kernels compute in float32 and round
  once into their output; LoHa's and LoKr's products in the factors' dtype, as their reference forms them): one
  addmm reads W0 and writes the weight, the floor a merge can reach; otherwise in a float32 block of rows
  (layer_writer.py, which also says what each kind of member adds);
- float8 weights (--quantize fp8) get torchao's per-tensor quantization of that rounded sum, written into the
  same data and scale tensors (fp8_merges.py);
- changing adapters restores, from the pristine copy, only the layers the previous merge touched and the
  new one does not.
So the same stack at the same strengths always writes the same bits.

One FusedWeights merges the denoiser's layers (fused swaps, --fuse auto|always), another the text encoders' (whenever a
resident adapter changes them, fused or not); both draw on one PristineWeights, keyed by (component, module).

Nothing waits for the device: the factors come from the device hot set when they are there (else they are copied
without blocking), and whether a merge can overflow is decided on the host (overflow_bounds.py). Only a layer
whose bound reaches the dtype's largest value (or whose figures are unknown, or a weight decomposition's) has its
result checked: a merge whose result is not finite in the model's dtype is refused and leaves the base weights as
they were before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, ModelLayers, StackMember
from loraswap.server.engine.adapters.residency.layer_writer import LayerWriter
from loraswap.server.engine.adapters.residency.overflow_bounds import may_overflow, overflow_error
from loraswap.server.engine.adapters.residency.pristine_weights import LayerKey, PristineWeights
from loraswap.server.engine.fuse_policy import MergeWork

# An adapter's slot factors on the merge's device, by module: (a, b), from the device hot set when it holds them.
SlotFactors = Callable[[CanonicalAdapter], Mapping[str, tuple[torch.Tensor, torch.Tensor]]]


class FusedWeights:
    """Writes stacks into the base weights of `components` from their pristine copies. Worker thread only.

    `slot_component`: the component whose layers canonical adapters' `layers` (the slot's LoRA factors) name.
    """

    def __init__(self, pristine: PristineWeights, components: frozenset[str], slot_component: str) -> None:
        self.pristine = pristine
        self.components = components
        self.slot_component = slot_component
        self._touched: set[LayerKey] = set()  # layers whose base weights hold a merge now
        self._slot_keys = tuple(key for key in pristine.weights if key[0] in components)
        self._layer_writer = LayerWriter(
            pristine, slot_component, max((pristine.weights[key].numel() for key in self._slot_keys), default=0)
        )

    @classmethod
    def over_layers(cls, component: str, layers: dict[str, torch.nn.Module]) -> FusedWeights:
        """A writer over these layers of one component alone (a slot's base layers), their copies taken now: what a
        --fuse auto|always server keeps for its slot, for code that holds a bare denoiser (benchmarks, tests)."""
        pristine = PristineWeights(
            ModelLayers.of_layers(component, layers), keep=[(component, name) for name in layers]
        )
        return cls(pristine, frozenset({component}), component)

    @property
    def touched(self) -> frozenset[LayerKey]:
        """The layers whose base weights hold a merge now."""
        return frozenset(self._touched)

    def layers_of(self, members: Iterable[StackMember]) -> set[LayerKey]:
        """The layers of these components a stack changes."""
        return _layers_of(members, self.components, self.slot_component)

    def merge_work(self, members: Iterable[StackMember]) -> MergeWork:
        """What merging these members reads, writes and multiplies (--fuse auto's merge cost): the layers, their
        base weights' bytes, and each weight's elements times the members' product rank there."""
        members = tuple(members)
        keys = self.layers_of(members)
        macs = 0
        for key in keys:
            rank = 0
            for adapter, _ in members:
                layer = adapter.layers.get(key[1]) if key[0] == self.slot_component else None
                if layer is not None:
                    rank += layer.rank
                change = adapter.changes.get(key)
                if change is not None:
                    rank += change.product_rank
            macs += self.pristine.model_layers.module(*key).weight.numel() * rank
        return MergeWork(layers=len(keys), weight_bytes=self.pristine.weight_bytes(keys), product_macs=macs)

    def full_merge_work(self, rank: int) -> MergeWork:
        """merge_work of an adapter of `rank` on every slot layer."""
        elements = sum(self.pristine.weights[key].numel() for key in self._slot_keys)
        return MergeWork(layers=len(self._slot_keys), weight_bytes=self.all_weight_bytes, product_macs=elements * rank)

    def merge_bytes(self, members: Iterable[StackMember]) -> int:
        """Bytes of the base weights a merge of these members reads and writes."""
        return self.pristine.weight_bytes(self.layers_of(members))

    @property
    def all_weight_bytes(self) -> int:
        """Bytes of every slot layer's base weight: what a merge over all of them reads and writes."""
        return self.pristine.weight_bytes(self._slot_keys)

    @torch.no_grad()
    def merge(self, members: tuple[StackMember, ...], slot_factors: SlotFactors | None = None) -> float:
        """Make the base weights hold W0 plus the members' changes (none: W0 everywhere); returns the host's ms.

        `slot_factors`: where the members' slot factors are on this device (the hot set); None: copied from the
        host as each layer needs them. Nothing waits for the device unless a layer's bound reaches the dtype.

        Raises:
            InvalidRequestError: ADAPTER_OUT_OF_RANGE when a merged weight is not finite in the model's dtype;
                the base weights then hold W0 on every layer (nothing is fused).
            AdapterTooLargeError: FUSE_MEMORY_EXCEEDED when the pristine copies the merge needs pass their budget;
                nothing has changed then.
        """
        started = time.perf_counter()
        wanted = self.layers_of(members)
        self.pristine.cover(wanted)
        for key in sorted(self._touched - wanted):
            self._layer_writer.restore(key)
        self._touched &= wanted
        factors = (
            {id(adapter): slot_factors(adapter) for adapter, _ in members if adapter.layers} if slot_factors else {}
        )
        try:
            checked = []  # (layer, whether its result is finite): only layers whose bound reaches the dtype
            for key in sorted(wanted):
                self._touched.add(key)
                check = may_overflow(self.pristine, self.slot_component, key, members)
                finite = self._layer_writer.merge(key, members, factors, check=check)
                if finite is not None:
                    checked.append((key, finite))
            # One read for every checked layer at the end (a device sync per layer would cost more than the merge).
            if checked and not bool(torch.stack([finite for _, finite in checked]).all()):
                bad = next(key for key, finite in checked if not bool(finite))
                raise overflow_error(self.pristine, self.slot_component, bad, members)
        except BaseException:
            self.restore()
            raise
        return (time.perf_counter() - started) * 1000.0

    @torch.no_grad()
    def restore(self) -> float:
        """Every base weight back to its pristine W0; returns ms spent."""
        started = time.perf_counter()
        for key in sorted(self._touched):
            self._layer_writer.restore(key)
        self._touched.clear()
        return (time.perf_counter() - started) * 1000.0


def _layers_of(members: Iterable[StackMember], components: frozenset[str], slot_component: str) -> set[LayerKey]:
    """The layers of `components` a stack changes."""
    keys = set()
    for adapter, _ in members:
        if slot_component in components:
            keys.update((slot_component, module) for module in adapter.layers)
        keys.update(key for key in adapter.changes if key[0] in components)
    return keys
