"""One layer's fused merge written into its base weight (and bias) from its pristine copy, or its W0 written back.

Each layer takes the cheapest exact path its changes allow, the sum accumulated in float32 and rounded once to the
model's dtype:
- only plain LoRAs at one alpha: one addmm reads W0 and writes the weight in its own dtype, the floor a merge can
  reach (own_dtype_merges.write_lora);
- one LoHa or LoKr alone: straight into the weight in its own dtype too (own_dtype_merges.write_change);
- anything else: W0 and every change summed in a float32 block of rows (a whole layer on a GPU, or where a change
  is only formed whole), rounded once into the weight;
- a float8 weight (--quantize fp8): the merge in the model's dtype, then torchao's per-tensor quantization of it
  written into the same data and scale tensors (fp8_merges.py).

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

The scratches (float32 blocks, DoRA's W0 + s B A, own_dtype_merges' products, a float8 layer's merge in the model's
dtype) are made once and grown to the largest layer merged: no allocation per layer and swap.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from loraswap.server.engine.adapters.formats import LayerChange, LowRank, StackMember
from loraswap.server.engine.adapters.residency.fp8_merges import is_float8_weight, scales_in_range, write_fp8
from loraswap.server.engine.adapters.residency.own_dtype_merges import (
    LOHA_BLOCK_ELEMENTS,
    OWN_DTYPES,
    all_finite,
    own_dtype_change,
    write_change,
    write_lora,
)
from loraswap.server.engine.adapters.residency.pristine_weights import LayerKey, PristineWeights

# On the CPU a layer is merged a block of rows at a time, in a float32 scratch of this many elements (2 MiB) that
# stays in a core's cache: main memory then sees W0 read and the weight written once each, as a plain copy
# would (a whole-layer float32 scratch costs three times that traffic; on SDXL's layer shapes blocks are 1.5x faster).
# Rows do not mix in a merge, so for plain LoRAs the blocks write the bits a whole-layer merge writes (other kinds'
# products, formed per block, may round differently from a whole-layer product, the same way every time). A GPU
# merges whole layers.
CPU_SCRATCH_ELEMENTS = 1 << 19


class LayerWriter:
    """Writes merges into the layers of `pristine`, one layer at a time, and W0 back. Worker thread only.

    `slot_component`: the component whose layers canonical adapters' `layers` (the slot's LoRA factors) name;
    `scratch_elements`: the float32 scratch made now (the largest layer merges will take), grown as needed.
    """

    def __init__(self, pristine: PristineWeights, slot_component: str, scratch_elements: int) -> None:
        self.pristine = pristine
        self.slot_component = slot_component
        self._biased: set[LayerKey] = set()  # layers whose biases hold a merge now
        first = next(iter(pristine.model_layers.modules.values()), None)
        self._device = first.weight.device if first is not None else torch.device("cpu")
        # Float32 scratch for the sum (and for DoRA's W0 + s BA), grown to the largest layer merged: no
        # allocation per layer and swap.
        self._sum = torch.empty(0, dtype=torch.float32, device=self._device)
        self._dora = None  # made on the first DoRA merge
        self._products = None  # own_dtype_merges' scratch, made on the first merge that needs it
        self._rounded_scratch = None  # a float8 layer's merge in the model's dtype, made on the first one
        self._whole(scratch_elements)

    def merge(self, key: LayerKey, members: tuple[StackMember, ...], factors: dict, check: bool) -> torch.Tensor | None:
        """Write W0 + the members' changes into one layer's base weight (and bias); returns whether the result is
        finite, as a device tensor (read once for all layers), when `check` (the host's bound of the result reaches
        the dtype's largest value); else None. `factors`: the members' slot factors already on this device, (a, b)
        by module under id(adapter); an adapter absent there has its factors copied from the host."""
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

    def restore(self, key: LayerKey) -> None:
        """The layer's weight and bias back to their pristine W0 and b0."""
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

    def _whole(self, elements: int) -> torch.Tensor:
        """A float32 scratch of at least `elements` (a whole layer's)."""
        if self._sum.numel() < elements:
            self._sum = torch.empty(elements, dtype=torch.float32, device=self._device)
        return self._sum

    def _factor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device, non_blocking=True).to(torch.float32)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device, non_blocking=True)

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
