"""Fused swaps: the resident adapters merged into the base weights of the slot layers they touch, exactly.

With an adapter fused, each layer it changes holds W0 + sum_i s_i * B_i A_i in its own base weight
(the very tensor the compiled graphs read, so addresses and CUDA graphs stay valid) and the LoRA
branch is skipped as for the base model: a step costs what the base model's does.

Exact by construction, whatever ran before:
- every merge starts from the layer's pristine W0, a copy kept apart at start-up (`PristineWeights`),
  never from a fused state and never by subtracting a previous merge (diffusers' fuse/unfuse drifts in
  low precision with every round trip);
- the sum is accumulated in float32 and rounded once to the model's dtype;
- changing adapters restores, from the pristine copy, only the layers the previous merge touched and the
  new one does not.
So the same stack at the same strengths always writes the same bits.

What is merged, per member of the stack (PEFT's own arithmetic, `peft.tuners.lora` Linear.merge and
DoraLinearVariant.merge_unsafe; a stack adds each member's change to W0 as PEFT's forward does with
several adapters active):
- a LoRA: s * B A (canonical `b` has alpha/rank baked in);
- a DoRA adapter: (m / ||W0 + s B A||_row) * (W0 + s B A) - W0, its magnitude m per output row;
- a trained lora_B bias: s * bias, added to the layer's bias.

A merge whose result is not finite in the model's dtype (an adapter overflowing it at this strength) is
refused and leaves the base weights as they were before it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from loraswap.server.engine.adapters.canonical import StackMember
from loraswap.server.engine.errors import ErrorReason, InvalidRequestError

# On the CPU a layer is merged a block of rows at a time, in a float32 scratch of this many elements (2 MiB) that
# stays in a core's cache: main memory then sees W0 read and the weight written once each, as a plain copy
# would (a whole-layer float32 scratch costs three times that traffic; on SDXL's layer shapes blocks are 1.5x faster).
# Rows do not mix in a merge, so the blocks write the bits a whole-layer merge writes. A GPU merges whole layers.
CPU_SCRATCH_ELEMENTS = 1 << 19


class PristineWeights:
    """A copy of each slot layer's base weight (and bias), on the model's device, taken before any merge."""

    def __init__(self, base_layers: dict[str, torch.nn.Module]) -> None:
        self.layers = base_layers
        self.weights = {name: layer.weight.detach().clone() for name, layer in base_layers.items()}
        self.biases = {
            name: layer.bias.detach().clone() for name, layer in base_layers.items() if layer.bias is not None
        }

    @staticmethod
    def bytes_needed(base_layers: dict[str, torch.nn.Module]) -> int:
        """What the copies of these layers take, before taking them."""
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in base_layers.values()
            for tensor in (layer.weight, layer.bias)
            if tensor is not None
        )

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in (*self.weights.values(), *self.biases.values()))

    def weight_bytes(self, names: Iterable[str]) -> int:
        """Bytes of the named layers' base weights: what a merge into them reads and writes."""
        return sum(self.weights[name].numel() * self.weights[name].element_size() for name in names)


class FusedWeights:
    """Writes stacks into the slot layers' base weights from their pristine copies. Worker thread only."""

    def __init__(self, pristine: PristineWeights) -> None:
        self.pristine = pristine
        self._touched: set[str] = set()  # layers whose base weights hold a merge now
        self._device = next(iter(pristine.weights.values())).device if pristine.weights else torch.device("cpu")
        largest = max((weight.numel() for weight in pristine.weights.values()), default=0)
        self._block = min(largest, CPU_SCRATCH_ELEMENTS) if self._device.type == "cpu" else largest
        # One float32 scratch for the sum and one for DoRA's W0 + s BA: no allocation per layer and swap.
        self._sum = torch.empty(largest, dtype=torch.float32, device=self._device)
        self._dora = None  # made on the first DoRA merge

    @property
    def touched(self) -> frozenset[str]:
        """The layers whose base weights hold a merge now."""
        return frozenset(self._touched)

    def merge_bytes(self, members: Iterable[StackMember]) -> int:
        """Bytes of the base weights a merge of these members reads and writes."""
        return self.pristine.weight_bytes(_layers_of(members))

    @property
    def all_weight_bytes(self) -> int:
        """Bytes of every slot layer's base weight: what a merge over all of them reads and writes."""
        return self.pristine.weight_bytes(self.pristine.weights)

    @torch.no_grad()
    def merge(self, members: tuple[StackMember, ...]) -> float:
        """Make the base weights hold W0 plus the members' changes (none: W0 everywhere); returns ms spent.

        Raises:
            InvalidRequestError: ADAPTER_OUT_OF_RANGE when a merged weight is not finite in the model's dtype;
                the base weights then hold W0 on every layer (nothing is fused).
        """
        started = time.perf_counter()
        wanted = _layers_of(members)
        for name in sorted(self._touched - wanted):
            self._restore(name)
        self._touched &= wanted
        try:
            finite = []
            for name in sorted(wanted):
                self._touched.add(name)
                finite.append(self._merge_layer(name, members))
            # One check for every layer at the end (a device sync per layer would cost more than the merge).
            if finite and not bool(torch.stack(finite).all()):
                bad = next(name for name, ok in zip(sorted(wanted), finite) if not bool(ok))
                raise _overflow_error(bad, members)
        except BaseException:
            self.restore()
            raise
        return (time.perf_counter() - started) * 1000.0

    @torch.no_grad()
    def restore(self) -> float:
        """Every base weight back to its pristine W0; returns ms spent."""
        started = time.perf_counter()
        for name in sorted(self._touched):
            self._restore(name)
        self._touched.clear()
        return (time.perf_counter() - started) * 1000.0

    def _restore(self, name: str) -> None:
        layer = self.pristine.layers[name]
        layer.weight.copy_(self.pristine.weights[name])
        if layer.bias is not None:
            layer.bias.copy_(self.pristine.biases[name])

    def _factor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device, non_blocking=True).to(torch.float32)

    def _merge_layer(self, name: str, members: tuple[StackMember, ...]) -> torch.Tensor:
        """Write W0 + the members' changes into one layer's base weight (and bias); returns whether the result is
        finite, as a device tensor (read once for all layers)."""
        layer = self.pristine.layers[name]
        w0 = self.pristine.weights[name]
        plain_b, plain_a, dora, biases = [], [], [], []
        for adapter, scale in members:
            factors = adapter.layers.get(name)
            if factors is None:
                continue
            if factors.magnitude is None:
                plain_b.append(self._factor(factors.b) * scale)
                plain_a.append(self._factor(factors.a))
            else:
                dora.append((factors, scale))
            if factors.bias is not None:
                biases.append((factors.bias, scale))
        if not dora:
            finite = self._merge_plain_rows(layer.weight, w0, plain_b, plain_a)
            return self._merge_bias(name, layer, biases, finite)
        merged = self._sum[: w0.numel()].view(w0.shape)
        merged.copy_(w0)
        if plain_b:
            # A sum of LoRAs is one LoRA of their factors side by side: one product for the whole stack.
            merged.addmm_(torch.cat(plain_b, dim=1), torch.cat(plain_a, dim=0))
        for factors, scale in dora:
            if self._dora is None or self._dora.numel() < w0.numel():
                self._dora = torch.empty_like(self._sum)
            directed = self._dora[: w0.numel()].view(w0.shape)
            directed.copy_(w0)
            directed.addmm_(self._factor(factors.b) * scale, self._factor(factors.a))
            norm = torch.linalg.vector_norm(directed, dim=1)
            directed.mul_((self._factor(factors.magnitude) / norm).unsqueeze(1))
            merged.add_(directed).sub_(w0)
        layer.weight.copy_(merged)
        return self._merge_bias(name, layer, biases, _all_finite(layer.weight))

    def _merge_plain_rows(
        self, weight: torch.Tensor, w0: torch.Tensor, plain_b: list[torch.Tensor], plain_a: list[torch.Tensor]
    ) -> torch.Tensor:
        """weight = W0 + sum of the LoRAs' s B A, a block of rows at a time (see CPU_SCRATCH_ELEMENTS): each block
        W0 into float32, the product added there, rounded once into the weight. Returns whether it is finite."""
        b = torch.cat(plain_b, dim=1) if plain_b else None
        a = torch.cat(plain_a, dim=0) if plain_a else None
        rows = max(1, self._block // w0.shape[1])
        finite = []
        for start in range(0, w0.shape[0], rows):
            stop = min(w0.shape[0], start + rows)
            block = self._sum[: (stop - start) * w0.shape[1]].view(stop - start, w0.shape[1])
            block.copy_(w0[start:stop])
            if b is not None:
                # A sum of LoRAs is one LoRA of their factors side by side: one product for the whole stack.
                block.addmm_(b[start:stop], a)
            written = weight[start:stop]
            written.copy_(block)
            finite.append(_all_finite(written))  # the block is still in cache
        return torch.stack(finite).all()

    def _merge_bias(self, name: str, layer: torch.nn.Module, biases: list, finite: torch.Tensor) -> torch.Tensor:
        if biases and layer.bias is not None:
            bias = self.pristine.biases[name].to(torch.float32)
            for vector, scale in biases:
                bias = bias + self._factor(vector) * scale
            layer.bias.copy_(bias)
            finite = finite & _all_finite(layer.bias)
        return finite


def _layers_of(members: Iterable[StackMember]) -> set[str]:
    """The slot layers a stack changes."""
    return {name for adapter, _ in members for name in adapter.layers}


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether every value is finite, as a device tensor: its float32 sum is (an inf or a NaN makes any sum inf or
    NaN), at a tenth of torch.isfinite's cost on the CPU. Finite values whose sum overflows float32 (a weight
    near 1e38) count as not finite: a merge that makes them is refused too."""
    return torch.isfinite(tensor.sum(dtype=torch.float32))


def _overflow_error(layer: str, members: tuple[StackMember, ...]) -> InvalidRequestError:
    return InvalidRequestError(
        f"merging the adapter{'s' if len(members) > 1 else ''} into layer {layer} gives values the model's dtype "
        "cannot hold; lower adapter_scale (or the stack's scales) or use another adapter",
        reason=ErrorReason.ADAPTER_OUT_OF_RANGE,
        field="adapter_scale" if len(members) == 1 else "adapters",
    )
