"""Fused swaps: the resident adapters merged into the base weights of the layers they touch, exactly.

With an adapter fused, each layer it changes holds W0 + sum_i s_i * B_i A_i in its own base weight
(the very tensor the compiled graphs read, so addresses and CUDA graphs stay valid) and the LoRA
branch is skipped as for the base model: a step costs what the base model's does.

Exact by construction, whatever ran before:
- every merge starts from the layer's pristine W0, a copy kept apart (`PristineWeights`: the slot layers' at
  start-up, any other layer's before the first merge that touches it), never from a fused state and never by
  subtracting a previous merge (diffusers' fuse/unfuse drifts in low precision with every round trip);
- the sum is accumulated in float32 and rounded once to the model's dtype: for a layer that only plain LoRAs at
  one alpha change, or one LoHa or LoKr alone, straight into the weight in its own dtype, on the CPU and on a GPU
  alike (own_dtype_merges.py: bfloat16 and float32 products and pointwise kernels compute in float32 and round
  once into their output; LoHa's and LoKr's products in the factors' dtype, as their reference forms them): one
  addmm reads W0 and writes the weight, the floor a merge can reach; otherwise in a float32 block of rows;
- float8 weights (--quantize fp8) get torchao's per-tensor quantization of that rounded sum, written into the
  same data and scale tensors (fp8_merges.py);
- changing adapters restores, from the pristine copy, only the layers the previous merge touched and the
  new one does not.
So the same stack at the same strengths always writes the same bits.

What is merged, per member of the stack (PEFT's own arithmetic, `peft.tuners.lora` Linear.merge and
DoraLinearVariant.merge_unsafe; a stack adds each member's change to W0 as PEFT's forward does with
several adapters active):
- a LoRA: s * B A (canonical `b` has alpha/rank baked in);
- a DoRA adapter: (m / ||W0 + s B A||_row) * (W0 + s B A) - W0, its magnitude m per output row;
- a trained lora_B bias: s * bias, added to the layer's bias;
- any other change (a LyCORIS kind, a LoRA of a layer outside the slot, a text-encoder layer): its
  `LayerChange.add_rows` (weight_changes.py, the LyCORIS references' arithmetic), its bias likewise; a change
  only formed whole (one cut from a stacked layer, a DoRA normalised per column) and PEFT DoRA merge the whole
  layer at once (`add_to`).

One writer merges the denoiser's layers (fused swaps, --fuse auto|always), another the text encoders' (whenever a
resident adapter changes them, fused or not); both draw on one PristineWeights, keyed by (component, module).

Nothing waits for the device: the factors come from the device hot set when they are there (else they are copied
without blocking), and whether a merge can overflow is decided on the host, from W0's largest value (taken when its
pristine copy is) and each member's largest change (taken where the adapter loaded, change_effects.py). Only a layer
whose bound reaches the dtype's largest value (or whose figures are unknown, or a weight decomposition's) has its
result checked: a merge whose result is not finite in the model's dtype is refused and leaves the base weights as
they were before it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, LayerChange, LowRank, ModelLayers, StackMember
from loraswap.server.engine.adapters.residency.fp8_merges import is_float8_weight, scales_in_range, write_fp8
from loraswap.server.engine.adapters.residency.own_dtype_merges import (
    LOHA_BLOCK_ELEMENTS,
    OWN_DTYPES,
    all_finite,
    own_dtype_change,
    write_change,
    write_lora,
)
from loraswap.server.engine.errors import AdapterTooLargeError, ErrorReason, InvalidRequestError
from loraswap.server.engine.fuse_policy import MergeWork

# On the CPU a layer is merged a block of rows at a time, in a float32 scratch of this many elements (2 MiB) that
# stays in a core's cache: main memory then sees W0 read and the weight written once each, as a plain copy
# would (a whole-layer float32 scratch costs three times that traffic; on SDXL's layer shapes blocks are 1.5x faster).
# Rows do not mix in a merge, so for plain LoRAs the blocks write the bits a whole-layer merge writes (other kinds'
# products, formed per block, may round differently from a whole-layer product, the same way every time). A GPU
# merges whole layers.
CPU_SCRATCH_ELEMENTS = 1 << 19

LayerKey = tuple[str, str]  # (component, module path)
# An adapter's slot factors on the merge's device, by module: (a, b), from the device hot set when it holds them.
SlotFactors = Callable[[CanonicalAdapter], Mapping[str, tuple[torch.Tensor, torch.Tensor]]]


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


class FusedWeights:
    """Writes stacks into the base weights of `components` from their pristine copies. Worker thread only.

    `slot_component`: the component whose layers canonical adapters' `layers` (the slot's LoRA factors) name.
    """

    def __init__(self, pristine: PristineWeights, components: frozenset[str], slot_component: str) -> None:
        self.pristine = pristine
        self.components = components
        self.slot_component = slot_component
        self._touched: set[LayerKey] = set()  # layers whose base weights hold a merge now
        self._biased: set[LayerKey] = set()  # layers whose biases hold a merge now
        self._slot_keys = tuple(key for key in pristine.weights if key[0] in components)
        first = next(iter(pristine.model_layers.modules.values()), None)
        self._device = first.weight.device if first is not None else torch.device("cpu")
        # Float32 scratch for the sum (and for DoRA's W0 + s BA), grown to the largest layer merged: no
        # allocation per layer and swap.
        self._sum = torch.empty(0, dtype=torch.float32, device=self._device)
        self._dora = None  # made on the first DoRA merge
        self._products = None  # own_dtype_merges' scratch, made on the first merge that needs it
        self._rounded_scratch = None  # a float8 layer's merge in the model's dtype, made on the first one
        self._whole(max((pristine.weights[key].numel() for key in self._slot_keys), default=0))

    @classmethod
    def over_layers(cls, component: str, layers: dict[str, torch.nn.Module]) -> FusedWeights:
        """A writer over these layers of one component alone (a slot's base layers), their copies taken now: what a
        --fuse auto|always server keeps for its slot, for code that holds a bare denoiser (benchmarks, tests)."""
        pristine = PristineWeights(
            ModelLayers.of_layers(component, layers), keep=[(component, name) for name in layers]
        )
        return cls(pristine, frozenset({component}), component)

    def _whole(self, elements: int) -> torch.Tensor:
        """A float32 scratch of at least `elements` (a whole layer's)."""
        if self._sum.numel() < elements:
            self._sum = torch.empty(elements, dtype=torch.float32, device=self._device)
        return self._sum

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
            self._restore(key)
        self._touched &= wanted
        factors = (
            {id(adapter): slot_factors(adapter) for adapter, _ in members if adapter.layers} if slot_factors else {}
        )
        try:
            checked = []  # (layer, whether its result is finite): only layers whose bound reaches the dtype
            for key in sorted(wanted):
                self._touched.add(key)
                finite = self._merge_layer(key, members, factors, check=self._may_overflow(key, members))
                if finite is not None:
                    checked.append((key, finite))
            # One read for every checked layer at the end (a device sync per layer would cost more than the merge).
            if checked and not bool(torch.stack([finite for _, finite in checked]).all()):
                bad = next(key for key, finite in checked if not bool(finite))
                raise _overflow_error(bad, members, self._fitting_factor(bad, members))
        except BaseException:
            self.restore()
            raise
        return (time.perf_counter() - started) * 1000.0

    @torch.no_grad()
    def restore(self) -> float:
        """Every base weight back to its pristine W0; returns ms spent."""
        started = time.perf_counter()
        for key in sorted(self._touched):
            self._restore(key)
        self._touched.clear()
        self._biased.clear()
        return (time.perf_counter() - started) * 1000.0

    def _restore(self, key: LayerKey) -> None:
        layer = self.pristine.layers[key]
        if is_float8_weight(layer.weight):
            quantized = self.pristine.float8.get(key)
            if quantized is None:  # a copy taken before --quantize: start-up's quantization of it, bit for bit
                write_fp8(layer.weight, self.pristine.weights[key])
            else:
                layer.weight.qdata.copy_(quantized[0])
                layer.weight.scale.copy_(quantized[1])
        else:
            layer.weight.copy_(self.pristine.weights[key])
        if layer.bias is not None:
            layer.bias.copy_(self.pristine.biases[key])
        self._biased.discard(key)

    def _factor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device, non_blocking=True).to(torch.float32)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device, non_blocking=True)

    def _may_overflow(self, key: LayerKey, members: tuple[StackMember, ...]) -> bool:
        """Whether the layer's merge may pass its dtype's largest value: W0's largest value plus each member's largest
        change there times its strength reaches it, or a figure is unknown (an adapter made without them), or a
        weight decomposition changes the layer (its norms are not bounded by the change)."""
        bound = self.pristine.largest(key)
        for adapter, scale in members:
            slot = adapter.layers.get(key[1]) if key[0] == self.slot_component else None
            change = adapter.changes.get(key)
            if slot is None and change is None:
                continue
            if (slot is not None and slot.magnitude is not None) or (
                change is not None and change.dora_scale is not None
            ):
                return True
            effect = adapter.effects.get(key)
            if effect is None:
                return True
            bound += abs(scale) * effect
        return not bound < torch.finfo(self.pristine.weights[key].dtype).max

    def _fitting_factor(self, key: LayerKey, members: tuple[StackMember, ...]) -> float | None:
        """What the members' strengths may be multiplied by for the layer's bound to stay inside its dtype; None
        where a figure is unknown."""
        effects = [adapter.effects.get(key) for adapter, _ in members if key in _keys_of(adapter, self.slot_component)]
        if not effects or None in effects:
            return None
        changed = sum(abs(scale) * adapter.effects[key] for adapter, scale in members if adapter.effects.get(key))
        room = torch.finfo(self.pristine.weights[key].dtype).max - self.pristine.largest(key)
        return room / changed if changed > 0 and room > 0 else None

    def _merge_layer(
        self, key: LayerKey, members: tuple[StackMember, ...], factors: dict, check: bool
    ) -> torch.Tensor | None:
        """Write W0 + the members' changes into one layer's base weight (and bias); returns whether the result is
        finite, as a device tensor (read once for all layers), when `check`; else None."""
        layer = self.pristine.layers[key]
        w0 = self.pristine.weights[key]
        float8 = is_float8_weight(layer.weight)
        # A float8 weight is written from the merge in the model's dtype: a scratch as large as the layer.
        target = self._rounded(w0) if float8 else layer.weight
        one_product = self._one_product(key, members, w0, factors)
        own = self._own_dtype_change(key, members, w0) if one_product is None else None
        biases = []
        if one_product is not None:
            b, a, alpha = one_product
            block = CPU_SCRATCH_ELEMENTS if self._device.type == "cpu" else None
            finite = write_lora(target, w0, b, a, alpha, check and not float8, block)
        elif own is not None:
            change, strength = own
            device_change = dataclasses.replace(
                change.change, **{field.name: self._on_device(getattr(change.change, field.name))
                                  for field in dataclasses.fields(change.change)
                                  if isinstance(getattr(change.change, field.name), torch.Tensor)},
            )  # fmt: skip
            finite = write_change(target, w0, dataclasses.replace(change, change=device_change), strength,
                                  check and not float8, self._own_scratch(w0))  # fmt: skip
            biases = [(change.bias, strength)] if change.bias is not None else []
        else:
            finite, biases = self._merge_in_float32(key, members, w0, target, factors, check and not float8)
        if float8:
            write_fp8(layer.weight, target)
            finite = scales_in_range([layer.weight]).all() if check else None
        return self._merge_bias(key, layer, biases, finite, check)

    def _merge_in_float32(
        self,
        key: LayerKey,
        members: tuple[StackMember, ...],
        w0: torch.Tensor,
        target: torch.Tensor,
        factors: dict,
        check: bool,
    ) -> tuple[torch.Tensor | None, list]:
        """The general merge: W0 and every member's change summed in float32 (in row blocks where the changes allow),
        rounded once into `target`; returns (finiteness when `check`, the bias changes)."""  # fmt: skip
        plain_b, plain_a, dora, biases, changes = [], [], [], [], []
        for adapter, scale in members:
            slot = adapter.layers.get(key[1]) if key[0] == self.slot_component else None
            if slot is not None:
                a, b = factors[id(adapter)][key[1]] if id(adapter) in factors else (slot.a, slot.b)
                if slot.magnitude is None:
                    plain_b.append(self._factor(b) * scale)
                    plain_a.append(self._factor(a))
                else:
                    dora.append((slot, scale))
                if slot.bias is not None:
                    biases.append((slot.bias, scale))
            change = adapter.changes.get(key)
            if change is not None:
                changes.append((change, scale))
                if change.bias is not None:
                    biases.append((change.bias, scale))
        periods = [change.row_period for change, _ in changes]
        if not dora and None not in periods:
            finite = self._merge_rows(target, w0, plain_b, plain_a, changes, math.lcm(1, *periods), check)
            return finite, biases
        merged = self._whole(w0.numel())[: w0.numel()].view(w0.shape)
        merged.copy_(w0)
        rows = merged.view(w0.shape[0], -1)
        if plain_b:
            # A sum of LoRAs is one LoRA of their factors side by side: one product for the whole stack.
            rows.addmm_(torch.cat(plain_b, dim=1), torch.cat(plain_a, dim=0))
        for slot, scale in dora:
            if self._dora is None or self._dora.numel() < w0.numel():
                self._dora = torch.empty(w0.numel(), dtype=torch.float32, device=self._device)
            directed = self._dora[: w0.numel()].view(rows.shape)
            directed.copy_(w0.view(rows.shape))
            directed.addmm_(self._factor(slot.b) * scale, self._factor(slot.a))
            norm = torch.linalg.vector_norm(directed, dim=1)
            directed.mul_((self._factor(slot.magnitude) / norm).unsqueeze(1))
            rows.add_(directed).sub_(w0.view(rows.shape))
        for change, scale in changes:
            change.add_to(merged, w0, scale)
        target.copy_(merged)
        return (all_finite(target) if check else None), biases

    def _rounded(self, w0: torch.Tensor) -> torch.Tensor:
        """A scratch of the model's dtype in the layer's shape (a float8 weight's merge, before it is quantized)."""
        if self._rounded_scratch is None or self._rounded_scratch.numel() < w0.numel():
            self._rounded_scratch = torch.empty(w0.numel(), dtype=w0.dtype, device=self._device)
        return self._rounded_scratch[: w0.numel()].view(w0.shape)

    def _one_product(
        self, key: LayerKey, members: tuple[StackMember, ...], w0: torch.Tensor, factors: dict
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(B, A, alpha) on the layer's device when its whole merge is W0 + alpha * B A in the weight's own dtype:
        only plain LoRAs change it (the slot's factors, or LoRA / LoCon changes without a core, DoRA or bias), each
        at the same alpha (strength, times alpha / rank for a change), their factors of the weight's dtype (bfloat16
        or float32). None otherwise."""
        if w0.dtype not in OWN_DTYPES:
            return None
        found = []  # (B, A, alpha)
        for adapter, scale in members:
            layer = adapter.layers.get(key[1]) if key[0] == self.slot_component else None
            if layer is not None:
                if layer.magnitude is not None or layer.bias is not None:
                    return None
                a, b = factors[id(adapter)][key[1]] if id(adapter) in factors else (layer.a, layer.b)
                found.append((b, a, scale))
            change = adapter.changes.get(key)
            if change is not None:
                low_rank = change.change
                plain = isinstance(low_rank, LowRank) and low_rank.mid is None
                if not plain or change.bias is not None or change.dora_scale is not None:
                    return None
                rows = low_rank.up.shape[0]
                found.append((low_rank.up.reshape(rows, -1), low_rank.down.reshape(low_rank.rank, -1),
                              scale * low_rank.scale))  # fmt: skip
        if not found or len({alpha for _, _, alpha in found}) > 1:
            return None
        if any(b.dtype != w0.dtype or a.dtype != w0.dtype for b, a, _ in found):
            return None
        if len(found) == 1:
            b, a, alpha = found[0]
            return self._on_device(b), self._on_device(a), alpha
        b = torch.cat([self._on_device(b) for b, _, _ in found], dim=1)
        return b, torch.cat([self._on_device(a) for _, a, _ in found], dim=0), found[0][2]

    def _own_dtype_change(
        self, key: LayerKey, members: tuple[StackMember, ...], w0: torch.Tensor
    ) -> tuple[LayerChange, float] | None:
        """(change, strength) when one member's change alone alters the layer and own_dtype_merges writes it (a LoHa
        without cores or a LoKr, in the weight's dtype); None otherwise."""
        found = []
        for adapter, scale in members:
            if key[0] == self.slot_component and key[1] in adapter.layers:
                return None
            change = adapter.changes.get(key)
            if change is not None:
                found.append((change, scale))
        if len(found) != 1 or found[0][0].change is None or not own_dtype_change(found[0][0], w0.dtype):
            return None
        return found[0]

    def _own_scratch(self, w0: torch.Tensor) -> torch.Tensor:
        """Two LOHA_BLOCK_ELEMENTS blocks of the weight's dtype, made on first use."""
        if self._products is None or self._products.dtype != w0.dtype:
            self._products = torch.empty(2 * LOHA_BLOCK_ELEMENTS, dtype=w0.dtype, device=self._device)
        return self._products

    def _merge_rows(
        self,
        weight: torch.Tensor,
        w0: torch.Tensor,
        plain_b: list[torch.Tensor],
        plain_a: list[torch.Tensor],
        changes: list,
        period: int,
        check: bool,
    ) -> torch.Tensor | None:
        """weight = W0 + the LoRAs' s B A + the changes' rows, a block of rows at a time (see CPU_SCRATCH_ELEMENTS;
        a multiple of `period` rows, the changes' row_period): each block W0 into float32, the products and the
        changes' rows added there, rounded once into the weight. Returns whether it is finite when `check`."""  # fmt: skip
        rows_of_weight = weight.view(w0.shape[0], -1)
        w0 = w0.view(w0.shape[0], -1)
        b = torch.cat(plain_b, dim=1) if plain_b else None
        a = torch.cat(plain_a, dim=0) if plain_a else None
        block_elements = min(w0.numel(), CPU_SCRATCH_ELEMENTS) if self._device.type == "cpu" else w0.numel()
        rows = max(period, block_elements // w0.shape[1] // period * period)
        scratch = self._whole(rows * w0.shape[1])
        dora = any(change.dora_scale is not None for change, _ in changes)
        finite = []
        for start in range(0, w0.shape[0], rows):
            stop = min(w0.shape[0], start + rows)
            block = scratch[: (stop - start) * w0.shape[1]].view(stop - start, w0.shape[1])
            block.copy_(w0[start:stop])
            w0_rows = block.clone() if dora else block  # a weight decomposition's own W0 rows
            if b is not None:
                # A sum of LoRAs is one LoRA of their factors side by side: one product for the whole stack.
                block.addmm_(b[start:stop], a)
            for change, scale in changes:
                change.add_rows(block, w0_rows, scale, (start, stop), tuple(weight.shape))
            written = rows_of_weight[start:stop]
            written.copy_(block)
            if check:
                finite.append(all_finite(written))  # the block is still in cache
        return torch.stack(finite).all() if finite else None

    def _merge_bias(
        self, key: LayerKey, layer: torch.nn.Module, biases: list, finite: torch.Tensor | None, check: bool
    ) -> torch.Tensor | None:
        """The bias of b0 plus the members' bias changes; b0 again where a previous merge changed it and these do
        not (a layer the new stack touches too is not restored before it)."""
        if layer.bias is None:
            return finite
        if not biases:
            if key in self._biased:
                layer.bias.copy_(self.pristine.biases[key])
                self._biased.discard(key)
            return finite
        bias = self.pristine.biases[key].to(torch.float32)
        for vector, scale in biases:
            bias = bias + self._factor(vector).reshape(-1) * scale
        layer.bias.copy_(bias)
        self._biased.add(key)
        if not check:
            return finite
        return all_finite(layer.bias) if finite is None else finite & all_finite(layer.bias)


def _keys_of(adapter: CanonicalAdapter, slot_component: str) -> set[LayerKey]:
    """The layers an adapter changes (its slot layers under `slot_component`)."""
    return {(slot_component, module) for module in adapter.layers} | set(adapter.changes)


def _layers_of(members: Iterable[StackMember], components: frozenset[str], slot_component: str) -> set[LayerKey]:
    """The layers of `components` a stack changes."""
    keys = set()
    for adapter, _ in members:
        if slot_component in components:
            keys.update((slot_component, module) for module in adapter.layers)
        keys.update(key for key in adapter.changes if key[0] in components)
    return keys


def _overflow_error(key: LayerKey, members: tuple[StackMember, ...], fits: float | None) -> InvalidRequestError:
    component, module = key
    stack = len(members) > 1
    if fits is not None and fits > 0:
        hint = (f"the stack's strengths multiplied by at most {fits:.3g} fit" if stack
                else f"strengths up to {abs(members[0][1]) * fits:.3g} fit")  # fmt: skip
    else:
        hint = "lower adapter_scale (or the stack's scales) or use another adapter"
    return InvalidRequestError(
        f"merging the adapter{'s' if stack else ''} into layer {module} of the {component} gives values the model's "
        f"dtype cannot hold (its base weight is near that dtype's largest value); {hint}",
        reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
        field="adapters" if stack else "adapter_scale",
        layer=module,
    )
