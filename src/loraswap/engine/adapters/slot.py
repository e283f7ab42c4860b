"""The resident swap slot: max-rank LoRA weights on every targeted layer, rewritten in place.

The slot is a PEFT LoRA adapter loaded once at start-up (zero-effect, max
rank, alpha == rank so PEFT's own scaling is 1) before the denoiser is
compiled. Afterwards nothing about it changes but the values of its weights:
no config, no scaling, no shapes, so compiled graphs never see a difference.
An adapter change copies each layer's canonical factors into the first
`rank` rows of lora_A and columns of lora_B, zeroes whatever the previous
adapter left beyond them, and zeroes layers the new adapter does not use.
The strength is multiplied into lora_B during that copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loraswap.engine.adapters.canonical import CanonicalAdapter, SlotSpec
from loraswap.engine.types import ModelFamily

SLOT_ADAPTER_NAME = "loraswap_slot"


@dataclass
class _LiveLayer:
    a: torch.Tensor  # (max_rank, in) parameter data of lora_A
    b: torch.Tensor  # (out, max_rank) parameter data of lora_B
    resident_rank: int = 0  # columns/rows beyond this are zero


class HotswapSlot:
    """In-place writer of canonical adapters into the live LoRA weights. Worker thread only."""

    @classmethod
    def install(
        cls,
        denoiser: torch.nn.Module,
        layer_names: list[str],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> HotswapSlot:
        """Enable hotswap at max rank and load a zero-effect placeholder on every layer; before any compile."""
        if hasattr(denoiser, "enable_lora_hotswap"):
            denoiser.enable_lora_hotswap(target_rank=max_rank)
        placeholder = {}
        for name in layer_names:
            layer = denoiser.get_submodule(name)
            # Fresh tensors for every key: diffusers may keep the very tensors it is given.
            placeholder[f"{name}.lora_A.weight"] = torch.zeros(max_rank, layer.in_features, dtype=dtype)
            placeholder[f"{name}.lora_B.weight"] = torch.zeros(layer.out_features, max_rank, dtype=dtype)
        denoiser.load_lora_adapter(placeholder, prefix=None, adapter_name=SLOT_ADAPTER_NAME)
        denoiser.to(device)
        denoiser.requires_grad_(False)
        return cls(denoiser, layer_names, max_rank)

    def __init__(self, denoiser: torch.nn.Module, layer_names: list[str], max_rank: int) -> None:
        self.max_rank = max_rank
        self._denoiser = denoiser
        self._layers: dict[str, _LiveLayer] = {}
        for name in layer_names:
            module = denoiser.get_submodule(name)
            a = module.lora_A[SLOT_ADAPTER_NAME].weight
            b = module.lora_B[SLOT_ADAPTER_NAME].weight
            if a.shape[0] != max_rank or b.shape[1] != max_rank:
                raise RuntimeError(f"slot layer {name} has rank {a.shape[0]}, expected {max_rank}")
            self._layers[name] = _LiveLayer(a=a.data, b=b.data)
        self.resident: CanonicalAdapter | None = None
        self.resident_scale = 1.0

    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    def spec(self, family: ModelFamily, dtype: torch.dtype, device: torch.device, *, strict: bool = False) -> SlotSpec:
        """What an adapter must fit to be loaded into this slot."""
        shapes = {}
        for name in self._layers:
            layer = self._denoiser.get_submodule(name).base_layer
            shapes[name] = (layer.in_features, layer.out_features)
        return SlotSpec(
            family=family,
            layer_shapes=shapes,
            max_rank=self.max_rank,
            dtype=dtype,
            device=device,
            denoiser_config=self._denoiser.config,  # diffusers' FrozenDict: its converters read attributes
            strict=strict,
        )

    def is_resident(self, adapter: CanonicalAdapter | None, scale: float) -> bool:
        """True when the slot already holds exactly this adapter object at this strength."""
        if adapter is None:
            return self.resident is None
        return self.resident is adapter and self.resident_scale == scale

    @torch.no_grad()
    def load(self, adapter: CanonicalAdapter | None, scale: float = 1.0) -> float:
        """Make `adapter` (None: the base model) resident at `scale`; returns milliseconds spent."""
        if self.is_resident(adapter, scale):
            return 0.0
        started = time.perf_counter()
        incoming = adapter.layers if adapter is not None else {}
        for name, live in self._layers.items():
            layer = incoming.get(name)
            rank = 0
            if layer is not None:
                rank = layer.rank
                live.a[:rank].copy_(layer.a, non_blocking=True)
                b_view = live.b[:, :rank]
                b_view.copy_(layer.b, non_blocking=True)
                if scale != 1.0:
                    b_view.mul_(scale)
            if live.resident_rank > rank:
                live.a[rank : live.resident_rank].zero_()
                live.b[:, rank : live.resident_rank].zero_()
            live.resident_rank = rank
        first = next(iter(self._layers.values()), None)
        if first is not None and first.a.is_cuda:
            torch.cuda.current_stream(first.a.device).synchronize()
        self.resident = adapter
        self.resident_scale = scale if adapter is not None else 1.0
        return (time.perf_counter() - started) * 1000.0

    def is_clean_beyond_resident(self) -> bool:
        """Invariant check: every weight past a layer's resident rank is zero (used by tests)."""
        return all(
            not live.a[live.resident_rank :].any() and not live.b[:, live.resident_rank :].any()
            for live in self._layers.values()
        )
