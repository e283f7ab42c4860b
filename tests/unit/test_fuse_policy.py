"""--fuse auto's rule as a pure function: fused when the steps about to run save more than the merge costs."""

from __future__ import annotations

import pytest

from loraswap.server.engine.fuse_policy import FuseCosts, buckets_auto_may_choose, choose_fused, fuse_pays

# policy, fusing, has_adapters, slot_can_hold, saving per step (ms), steps, merge ms, fused?
CHOICES = [
    ("auto", True, True, True, 10.0, 4, 30.0, True),  # 40 ms saved > 30 ms merge
    ("auto", True, True, True, 10.0, 3, 30.0, False),  # 30 ms saved == 30 ms merge: not more, keep the slot
    ("auto", True, True, True, 10.0, 2, 30.0, False),
    ("auto", True, True, True, 1.0, 1000, 30.0, True),  # a long run pays for any merge
    ("auto", True, True, True, 0.0, 1000, 0.1, False),  # the LoRA branch costs nothing: never worth a merge
    ("auto", True, True, False, 10.0, 1, 1e9, True),  # the slot cannot hold it (DoRA, rank past max): fused
    ("auto", True, True, True, None, 1, 1e9, True),  # no compiled graph for its bucket: fused
    ("auto", True, False, True, 10.0, 100, 1.0, False),  # the base model: nothing to fuse
    ("auto", False, True, True, 10.0, 100, 1.0, False),  # quantized weights: auto never fuses
    ("always", True, True, True, 0.0, 1, 1e9, True),
    ("always", True, False, True, 0.0, 1, 0.0, False),
    ("never", True, True, True, 100.0, 100, 0.0, False),
    ("never", False, True, True, 100.0, 100, 0.0, False),
]


@pytest.mark.parametrize(
    ("policy", "fusing", "has_adapters", "slot_can_hold", "saving", "steps", "merge_ms", "fused"), CHOICES
)
def test_choose_fused(policy, fusing, has_adapters, slot_can_hold, saving, steps, merge_ms, fused) -> None:
    chosen = choose_fused(
        policy, fusing=fusing, has_adapters=has_adapters, slot_can_hold=slot_can_hold,
        saving_ms_per_step=saving, steps=steps, merge_ms=merge_ms,
    )  # fmt: skip
    assert chosen is fused


def test_fuse_pays_is_strictly_more() -> None:
    assert fuse_pays(2.0, 5, 9.99) and not fuse_pays(2.0, 5, 10.0)


def _costs() -> FuseCosts:
    return FuseCosts(
        step_ms={0: 20.0, 16: 30.0}, measured_pixels=64 * 64, merge_ms_per_byte=1e-6, merge_ms_per_byte_rank=1e-8
    )


def test_saving_scales_with_the_image_and_is_unknown_for_an_unmeasured_bucket() -> None:
    costs = _costs()
    assert costs.saving_ms_per_step(16, 64 * 64) == pytest.approx(10.0)
    assert costs.saving_ms_per_step(16, 128 * 128) == pytest.approx(40.0)
    assert costs.saving_ms_per_step(32, 64 * 64) is None


def test_merge_cost_grows_with_bytes_and_rank_and_follows_real_merges() -> None:
    costs = _costs()
    assert costs.merge_ms(1_000_000, 0) == pytest.approx(1.0)
    assert costs.merge_ms(1_000_000, 100) == pytest.approx(2.0)
    costs.observe_merge(4.0, 1_000_000, 100)  # twice the prediction
    assert costs.merge_ms(1_000_000, 100) == pytest.approx(2.0 * 1.2)  # moved a fifth of the way
    for _ in range(50):
        costs.observe_merge(4.0, 1_000_000, 100)
    assert costs.merge_ms(1_000_000, 100) == pytest.approx(4.0, rel=1e-3)


# buckets, the smallest's saving per step, merge ms of a full-slot adapter per bucket, buckets auto may choose
WARMED = [
    ((16, 32, 64), 10.0, {16: 5.0, 32: 5.0, 64: 5.0}, ()),  # one step saves more than a merge: always fused
    ((16, 32, 64), 1.0, {16: 5.0, 32: 5.0, 64: 5.0}, (32, 64)),  # 2 ms at 32 < 5 ms; 4 ms at 64 < 5 ms
    ((16, 32, 64), 1.0, {16: 5.0, 32: 5.0, 64: 3.0}, (32,)),  # 4 ms at 64 > a 3 ms merge
    ((16, 32, 64), 0.1, {16: 5.0, 32: 5.0, 64: 5.0}, (32, 64)),
    ((16,), 0.1, {16: 5.0}, ()),
]


@pytest.mark.parametrize(("buckets", "saving", "merges", "expected"), WARMED)
def test_buckets_auto_may_choose(buckets, saving, merges, expected) -> None:
    assert buckets_auto_may_choose(buckets, saving, merges) == expected
