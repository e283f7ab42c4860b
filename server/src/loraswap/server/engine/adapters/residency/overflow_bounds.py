"""Whether a fused merge may pass its dtype's largest value, decided on the host; and the refusal of one that did.

Nothing waits for the device to decide: the bound of a layer's merge is W0's largest value (taken when its pristine
copy is, pristine_weights.py) plus each member's largest change there (taken where the adapter loaded,
change_effects.py) times its strength. Only a layer whose bound reaches the dtype's largest value (or whose figures
are unknown, or a weight decomposition's) has its result checked; a merge whose result is not finite in the model's
dtype is refused with `overflow_error`, which names the strengths that fit where the figures tell.
"""

from __future__ import annotations

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, StackMember
from loraswap.server.engine.adapters.residency.pristine_weights import LayerKey, PristineWeights
from loraswap.server.engine.errors import ErrorReason, InvalidRequestError


def may_overflow(
    pristine: PristineWeights, slot_component: str, key: LayerKey, members: tuple[StackMember, ...]
) -> bool:
    """Whether the layer's merge may pass its dtype's largest value: W0's largest value plus each member's largest
    change there times its strength reaches it, or a figure is unknown (an adapter made without them), or a
    weight decomposition changes the layer (its norms are not bounded by the change). `slot_component`: the
    component whose layers the members' slot factors name."""
    bound = pristine.largest(key)
    for adapter, scale in members:
        slot = adapter.layers.get(key[1]) if key[0] == slot_component else None
        change = adapter.changes.get(key)
        if slot is None and change is None:
            continue
        if (slot is not None and slot.magnitude is not None) or (change is not None and change.dora_scale is not None):
            return True
        effect = adapter.effects.get(key)
        if effect is None:
            return True
        bound += abs(scale) * effect
    return not bound < torch.finfo(pristine.weights[key].dtype).max


def overflow_error(
    pristine: PristineWeights, slot_component: str, key: LayerKey, members: tuple[StackMember, ...]
) -> InvalidRequestError:
    """ADAPTER_OUT_OF_RANGE for a merge of `members` whose result in the layer is not finite in the model's dtype,
    with the strengths that would fit where the figures tell them."""
    component, module = key
    stack = len(members) > 1
    fits = _fitting_factor(pristine, slot_component, key, members)
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


def _fitting_factor(
    pristine: PristineWeights, slot_component: str, key: LayerKey, members: tuple[StackMember, ...]
) -> float | None:
    """What the members' strengths may be multiplied by for the layer's bound to stay inside its dtype; None
    where a figure is unknown."""
    effects = [adapter.effects.get(key) for adapter, _ in members if key in _keys_of(adapter, slot_component)]
    if not effects or None in effects:
        return None
    changed = sum(abs(scale) * adapter.effects[key] for adapter, scale in members if adapter.effects.get(key))
    room = torch.finfo(pristine.weights[key].dtype).max - pristine.largest(key)
    return room / changed if changed > 0 and room > 0 else None


def _keys_of(adapter: CanonicalAdapter, slot_component: str) -> set[LayerKey]:
    """The layers an adapter changes (its slot layers under `slot_component`)."""
    return {(slot_component, module) for module in adapter.layers} | set(adapter.changes)
