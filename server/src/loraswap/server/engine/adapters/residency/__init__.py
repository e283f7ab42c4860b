"""Residency: how weight changes reach the resident model's weights.

The hotswap slot and its modules, swap plans and the copy stream, fused merges from pristine copies (each layer's
written in float32 blocks, in the weight's own dtype or into float8, bounded on the host against overflow), the host
and device adapter caches, and the residency that decides each swap's path.

May import: formats/ (the canonical adapter and its weight changes) and the engine's leaves; reads no files
(sources/ does). Other code uses the names below, never a module inside.
"""

from __future__ import annotations

from loraswap.server.engine.adapters.residency.adapter_residency import (
    AdapterResidency,
    stack_order,
)
from loraswap.server.engine.adapters.residency.cache import (
    AdapterCache,
    CacheEntry,
)
from loraswap.server.engine.adapters.residency.copy_stream import (
    CopyStream,
)
from loraswap.server.engine.adapters.residency.device_cache import (
    DeviceAdapterCache,
)
from loraswap.server.engine.adapters.residency.fp8_merges import (
    is_float8_weight,
    reference_fp8,
    scales_in_range,
    write_fp8,
)
from loraswap.server.engine.adapters.residency.fused import (
    FusedWeights,
)
from loraswap.server.engine.adapters.residency.layer_writer import (
    CPU_SCRATCH_ELEMENTS,
)
from loraswap.server.engine.adapters.residency.pristine_weights import (
    PristineWeights,
)
from loraswap.server.engine.adapters.residency.slot import (
    SLOT_ADAPTER_NAME,
    HotswapSlot,
)
from loraswap.server.engine.adapters.residency.slot_modules import (
    RankGatedLinear,
)
from loraswap.server.engine.adapters.residency.swap_plan import (
    check_stack_fits,
    slot_can_hold,
)

__all__ = [
    "CPU_SCRATCH_ELEMENTS",
    "SLOT_ADAPTER_NAME",
    "AdapterCache",
    "AdapterResidency",
    "CacheEntry",
    "CopyStream",
    "DeviceAdapterCache",
    "FusedWeights",
    "HotswapSlot",
    "PristineWeights",
    "RankGatedLinear",
    "check_stack_fits",
    "is_float8_weight",
    "reference_fp8",
    "scales_in_range",
    "slot_can_hold",
    "stack_order",
    "write_fp8",
]
