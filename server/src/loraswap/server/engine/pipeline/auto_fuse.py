"""--fuse auto on the resident model: the rank buckets its rule may run a stack at unfused (the warm-up compiles
their graphs), and the start-up line that states the figures it decides by."""

from __future__ import annotations

from loraswap.server.engine.fuse_policy import buckets_auto_may_choose, device_costs, merge_ms, unfused_ms
from loraswap.server.engine.pipeline.lora_work import SMALLEST_BATCH_GUIDANCE, work_at_guidance
from loraswap.server.engine.pipeline.phase_clock import STARTUP_LOG
from loraswap.server.engine.pipeline.records import InstalledSlot, LoadedModel


def auto_buckets(loaded: LoadedModel, installed: InstalledSlot) -> tuple[int, ...]:
    """The rank buckets --fuse auto may run a stack at unfused (fuse_policy.buckets_auto_may_choose, with the
    cheapest step a request can ask for: the smallest image, the smallest batch); () when the server does not run
    auto."""
    if installed.lora_work is None:
        return ()
    work = work_at_guidance(loaded, installed.lora_work, SMALLEST_BATCH_GUIDANCE)
    fused = installed.residency.fused_weights
    buckets = installed.residency.slot.rank_buckets
    return buckets_auto_may_choose(
        device_costs(loaded.device.type), work, buckets, loaded.request_rules.min_size**2,
        {bucket: fused.full_merge_work(bucket) for bucket in buckets},
    )  # fmt: skip


def log_auto_rule(loaded: LoadedModel, installed: InstalledSlot) -> None:
    """The figures --fuse auto decides by (fuse_policy.py): the device type's constants and the LoRA work counted."""
    costs = device_costs(loaded.device.type)
    work = installed.lora_work
    defaults = loaded.defaults
    pixels = defaults.width * defaults.height
    buckets = installed.residency.slot.rank_buckets
    fused = installed.residency.fused_weights
    STARTUP_LOG.info(
        "--fuse auto: cost model for %s %s; LoRA work per step and rank: %d calls, %.4g MACs/pixel + %.4g MACs; at "
        "%dx%d one step unfused costs %s, a merge of every slot layer %s; buckets it may run unfused: %s",
        loaded.device.type, costs, work.calls, work.macs_per_pixel, work.fixed_macs, defaults.width, defaults.height,
        ", ".join(f"{unfused_ms(costs, work, b, 1, pixels):.3g} ms at {b}" for b in buckets),
        ", ".join(f"{merge_ms(costs, fused.full_merge_work(b)):.3g} ms at rank {b}" for b in buckets),
        ",".join(map(str, auto_buckets(loaded, installed))) or "none",
    )  # fmt: skip
