"""The canonical adapter: the one swap-ready form every adapter is converted into, once, before it touches the model.

A canonical adapter holds, for each layer it changes, `a` (rank x in) and `b`
(out x rank) in the model's dtype with alpha/rank (and any per-layer alpha)
already multiplied into `b`. The live swap slot is max-rank wide on every
targeted layer; a canonical adapter is stored at its own rank and the slot
gates off the ranks beyond it, so a swap is only in-place copies: no key
conversion, no config, no scale bookkeeping. Both factors are checked finite
in the model's dtype, and `b` finite at every allowed strength (admission.py,
tensor_checks.py), which is what makes the slot's gating exact.

Some adapters cannot live in the slot but can be fused (merged into the base
weights, adapters/residency/fused.py) when the server fuses (`SlotSpec.fuse`): DoRA
adapters (their per-row `magnitude`), LoRAs that train lora_B's bias (`bias`,
alpha/rank baked in like `b`) and ranks above the slot's max rank. Every other
change is a `LayerChange` (weight_changes.py) in `changes`, keyed by component
and module: LyCORIS kinds (LoHa, LoKr, LoCon with Tucker cores, full
differences, DoRA), denoiser layers the slot does not cover (convs,
`time_emb_proj`, embeddings) and text-encoder layers. Denoiser changes are only
ever fused; text-encoder changes are merged into the text encoders whichever
way the denoiser's part is applied. Adapters only a fused swap can apply are
marked `fits_slot=False`; under --fuse never they are refused as before.

load_canonical (canonical.py) makes one from an adapter file.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from loraswap.server.engine.adapters.formats.weight_changes import LayerChange, held_bytes

# CanonicalAdapter.content_key digests this many values from each end of every tensor.
CONTENT_KEY_VALUES = 64


def _change_numbers(change: LayerChange) -> str:
    """The numbers of a layer's change that are not tensors: its kind, scale, rows (a stacked layer's), DoRA ε."""
    kind = change.change
    inner = getattr(kind, "of", kind)
    return f"{change.kind}|{getattr(inner, 'scale', None)!r}|{getattr(kind, 'rows', None)!r}|{change.dora_eps!r}"


@dataclass(frozen=True)
class CanonicalLayer:
    """One layer's LoRA factors: a (rank x in) and b (out x rank), alpha baked into b.

    Fused only: `magnitude` (out,), a DoRA adapter's per-row magnitude; `bias` (out,), a trained lora_B bias
    with alpha baked in.
    """

    a: torch.Tensor
    b: torch.Tensor
    magnitude: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class CanonicalAdapter:
    """An adapter in swap-ready form."""

    name: str
    source: str
    layers: dict[str, CanonicalLayer]  # the denoiser's plain LoRA (and PEFT DoRA, bias) layers on slot layers
    warnings: tuple[str, ...]
    load_ms: float
    # False for an adapter only a fused swap can apply (DoRA, a trained bias, a rank above the slot's, any change
    # of the denoiser in `changes`).
    fits_slot: bool = True
    # (component, module) -> every other change: other kinds, other denoiser layers, text-encoder layers.
    changes: Mapping[tuple[str, str], LayerChange] = field(default_factory=dict)
    # (component, module) -> how far the adapter moves that layer at strength 1, its largest |ΔW| (change_effects.py):
    # what admitted it, and what a request's strengths and a merge's overflow bound are checked against.
    effects: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # A URL adapter's fetch (AdapterFile's): its milliseconds before load_ms, and the body bytes that came.
    download_ms: float = 0.0
    download_bytes: int = 0
    # Scratch space for the swap slot (the views it copies from, built on the first swap), so that it
    # lives and dies with the adapter. Not part of the adapter's identity.
    swap_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rank(self) -> int:
        """The highest rank of any layer (0 for changes of no rank: full differences, whole LoKr factors)."""
        ranks = [layer.rank for layer in self.layers.values()] + [change.rank for change in self.changes.values()]
        return max(ranks, default=0)

    @property
    def nbytes(self) -> int:
        """The bytes the adapter holds (the parts of a stacked layer share their tensors: counted once)."""
        return held_bytes(
            [tensor for layer in self.layers.values() for tensor in (layer.a, layer.b, layer.magnitude, layer.bias)
             if tensor is not None]
            + [tensor for change in self.changes.values() for tensor in change.tensors]
        )  # fmt: skip

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of change the adapter makes (lora, dora, lora+dora, loha, lokr, full, bias, ...), sorted."""
        kinds = {"dora" if layer.magnitude is not None else "lora" for layer in self.layers.values()}
        return tuple(sorted(kinds | {change.kind for change in self.changes.values()}))

    @functools.cached_property
    def content_key(self) -> str:
        """A digest of the adapter's layers: their names, shapes and dtypes, and each tensor's first and last
        values. What a stack's members are ordered by (residency.stack_order), so the names an adapter is reached
        by never change a stack's image; computed on first use."""
        digest = hashlib.sha256()
        parts = [
            (f"slot:{name}", (layer.a, layer.b, layer.magnitude, layer.bias)) for name, layer in self.layers.items()
        ]
        # A change's plain numbers (its alpha / rank, the weight decomposition's epsilon, a stacked layer's rows)
        # are part of it as much as its tensors.
        parts += [
            (f"{key[0]}:{key[1]}:{_change_numbers(change)}", change.tensors) for key, change in self.changes.items()
        ]
        for label, tensors in sorted(parts, key=lambda part: part[0]):
            digest.update(label.encode())
            for tensor in tensors:
                if tensor is None:
                    continue
                flat = tensor.detach().reshape(-1)
                digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
                for values in (flat[:CONTENT_KEY_VALUES], flat[-CONTENT_KEY_VALUES:]):
                    digest.update(values.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @functools.cached_property
    def changed_components(self) -> frozenset[str]:
        """The components `changes` changes (the slot layers' component only when it has changes beyond them)."""
        return frozenset(component for component, _ in self.changes)

    def layers_per_component(self, denoiser: str) -> dict[str, int]:
        """How many layers the adapter changes in each component (`denoiser`: the slot layers' component)."""
        counts = {denoiser: len(self.layers)} if self.layers else {}
        for component, _ in self.changes:
            counts[component] = counts.get(component, 0) + 1
        return dict(sorted(counts.items()))

    def changes_in(self, components: frozenset[str] | set[str]) -> dict[tuple[str, str], LayerChange]:
        """The changes of these components."""
        return {key: change for key, change in self.changes.items() if key[0] in components}


StackMember = tuple[CanonicalAdapter, float]  # an adapter and the strength it is applied at
