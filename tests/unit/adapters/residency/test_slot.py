"""The swap slot's rank gates: what a previous adapter leaves beyond the new rank has exactly no effect.

The slot never clears stale ranks; it closes them. These tests put a
high-rank adapter with large values into the slot, swap to a lower-rank one
(or to the base model), and compare every slot layer's output bit for bit
with a freshly installed slot that never held anything else.
"""

from __future__ import annotations

import pytest
import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer
from loraswap.server.engine.adapters.residency import RankGatedLinear, check_stack_fits, stack_order
from loraswap.server.engine.errors import AdapterIncompatibleError, ErrorReason
from loraswap.server.engine.families import FLUX
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from tests.support.slots import gates_match_resident, install_residency

torch.set_num_threads(1)

MAX_RANK = 16


def _denoiser_with_slot(dtype: torch.dtype):
    transformer = builtin_model("tiny-flux").build().transformer.to(dtype)
    layers = resolve_target_layers(transformer, FLUX.default_target_modules)
    return transformer, layers, install_residency(transformer, layers, MAX_RANK, dtype)


def _load(residency, adapter: CanonicalAdapter | None, scale: float = 1.0) -> float:
    """Make one adapter (None: the base model) resident at `scale`."""
    return residency.load_stack(() if adapter is None else ((adapter, scale),))


def _adapter(transformer, layers, rank: int, magnitude: float, dtype: torch.dtype, seed: int) -> CanonicalAdapter:
    generator = torch.Generator().manual_seed(seed)
    canonical = {}
    for name in layers:
        base = transformer.get_submodule(name).base_layer
        a = torch.randn(rank, base.in_features, generator=generator) * magnitude
        b = torch.randn(base.out_features, rank, generator=generator) * magnitude
        canonical[name] = CanonicalLayer(a=a.to(dtype), b=b.to(dtype))
    return CanonicalAdapter(name=f"r{rank}", source="test", layers=canonical, warnings=(), load_ms=0.0)


def _stale_slot(dtype: torch.dtype, stale_magnitude: float):
    """A slot, inputs for each of its layers, and a max-rank adapter whose values every case starts from."""
    transformer, layers, slot = _denoiser_with_slot(dtype)
    generator = torch.Generator().manual_seed(0)
    x = {
        name: (torch.randn(2, 3, transformer.get_submodule(name).in_features, generator=generator) * 4).to(dtype)
        for name in layers
    }
    return transformer, layers, slot, x, _adapter(transformer, layers, MAX_RANK, stale_magnitude, dtype, seed=1)


@torch.no_grad()
def _outputs(transformer, layers, x_by_layer) -> dict[str, torch.Tensor]:
    return {name: transformer.get_submodule(name)(x_by_layer[name]) for name in layers}


@pytest.mark.parametrize(
    ("dtype", "stale_magnitude"),
    [
        pytest.param(torch.float32, 3.0, id="float32"),
        # float16: the stale ranks' projection A @ x overflows to inf; a multiplicative mask
        # would turn it into NaN, the gate must not.
        pytest.param(torch.float16, 2000.0, id="float16-overflowing-stale-ranks"),
    ],
)
def test_lower_rank_and_base_after_a_high_rank_adapter_match_a_fresh_slot(dtype, stale_magnitude):
    transformer, layers, slot, x, high = _stale_slot(dtype, stale_magnitude)
    low = _adapter(transformer, layers, 4, 0.1, dtype, seed=2)
    odd = _adapter(transformer, layers, 3, 0.1, dtype, seed=3)  # 6 or 12 bytes a row: copied element by element
    partial = CanonicalAdapter(
        name="partial", source="test", layers={layers[0]: low.layers[layers[0]]}, warnings=(), load_ms=0.0
    )

    _load(slot, high, 1.5)
    if dtype is torch.float16:
        assert not torch.isfinite(_outputs(transformer, layers, x)[layers[0]]).all(), "stale ranks must overflow"
    base = _outputs(_denoiser_with_slot(dtype)[0], layers, x)

    for adapter, scale in [(low, 0.7), (None, 1.0), (high, 1.0), (partial, 1.0), (odd, -1.5), (low, 1.0)]:
        _load(slot, high, 2.0)  # the stale values every case starts from
        _load(slot, adapter, scale)
        fresh_transformer, _, fresh_slot = _denoiser_with_slot(dtype)  # never held anything else
        _load(fresh_slot, adapter, scale)
        live, expected = _outputs(transformer, layers, x), _outputs(fresh_transformer, layers, x)
        for name in layers:
            # Bit for bit; NaN only where the fresh slot has it too (the high-rank adapter itself, in float16).
            torch.testing.assert_close(live[name], expected[name], rtol=0, atol=0, equal_nan=True)
            if adapter is not high:
                assert torch.isfinite(live[name]).all(), (adapter and adapter.name, name)
        if adapter is None:
            assert all(torch.equal(live[name], base[name]) for name in layers)
        else:  # the slot holds the adapter's own bytes (lora_B times the strength, in the model's dtype)
            for name, layer in adapter.layers.items():
                module = transformer.get_submodule(name)
                rank = layer.rank
                assert torch.equal(module.lora_A["loraswap_slot"].weight[:rank], layer.a)
                assert torch.equal(module.lora_B["loraswap_slot"].weight[:, :rank], layer.b * scale)
        assert gates_match_resident(slot.slot)
        # Nothing was cleared: the stale ranks still hold the high-rank adapter's values.
        a = transformer.get_submodule(layers[-1]).lora_A["loraswap_slot"].weight
        assert a[4:].abs().max() > 0


def test_slot_layers_are_gated_and_the_gate_is_not_saved():
    transformer, layers, slot = _denoiser_with_slot(torch.float32)
    for name in layers:
        assert isinstance(transformer.get_submodule(name).lora_A["loraswap_slot"], RankGatedLinear)
    assert not any("rank_gate" in key for key in transformer.state_dict())
    assert gates_match_resident(slot.slot)


def test_a_load_that_fails_part_way_leaves_no_stale_gate_behind():
    transformer, layers, slot = _denoiser_with_slot(torch.float32)
    high = _adapter(transformer, layers, MAX_RANK, 1.0, torch.float32, seed=1)
    low = _adapter(transformer, layers, 4, 0.1, torch.float32, seed=2)
    broken_layer = CanonicalLayer(a=torch.zeros(4, 3), b=torch.zeros(5, 4))  # shapes no slot layer has
    broken = CanonicalAdapter(
        name="broken", source="test", layers={**low.layers, layers[-1]: broken_layer}, warnings=(), load_ms=0.0
    )
    _load(slot, high)
    with pytest.raises(RuntimeError):
        _load(slot, broken)
    assert slot.resident_adapters == () and not slot.holds(())
    _load(slot, low)
    fresh_transformer, _, fresh_slot = _denoiser_with_slot(torch.float32)
    _load(fresh_slot, low)
    x = {name: torch.randn(2, transformer.get_submodule(name).in_features) for name in layers}
    live, expected = _outputs(transformer, layers, x), _outputs(fresh_transformer, layers, x)
    assert all(torch.equal(live[name], expected[name]) for name in layers)
    assert gates_match_resident(slot.slot)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lora_b_bytes_arrive_exactly_on_the_16_byte_path_and_off_it(dtype):
    transformer, layers, slot = _denoiser_with_slot(dtype)
    for rank in (8, 16, 3, 4):  # 16-byte rows (bf16/fp16 at 8 and 16, fp32 at 4, 8, 16) and element-wise ones
        adapter = _adapter(transformer, layers, rank, 0.3, dtype, seed=rank)
        _load(slot, adapter, 0.35)
        wide = [layer.wide for layer in adapter.swap_cache[next(iter(adapter.swap_cache))].layout]
        assert all(wide) == ((rank * torch.finfo(dtype).bits // 8) % 16 == 0)
        for name, layer in adapter.layers.items():
            lora_b = transformer.get_submodule(name).lora_B["loraswap_slot"].weight
            assert torch.equal(lora_b[:, :rank], layer.b * 0.35)
    # An adapter in another dtype than the slot's is converted, never byte-copied.
    other = torch.float32 if dtype != torch.float32 else torch.float16
    mismatched = _adapter(transformer, layers, 8, 0.3, other, seed=9)
    _load(slot, mismatched)
    for name, layer in mismatched.layers.items():
        lora_b = transformer.get_submodule(name).lora_B["loraswap_slot"].weight
        assert torch.equal(lora_b[:, :8], layer.b.to(dtype))


# -- stacks -------------------------------------------------------------------------------------------


def _named(adapter: CanonicalAdapter, name: str, layers=None) -> CanonicalAdapter:
    """`adapter` under another name, on `layers` only (default: all of its layers)."""
    kept = {layer: adapter.layers[layer] for layer in (layers or adapter.layers)}
    return CanonicalAdapter(name=name, source=f"test/{name}", layers=kept, warnings=(), load_ms=0.0)


def _assert_slot_holds(transformer, members) -> None:
    """Each member's bytes sit in consecutive rank ranges of its layers, in stack_order (by content); lora_B times its
    scale."""
    offsets: dict[str, int] = {}
    for adapter, scale in stack_order(members):
        for name, layer in adapter.layers.items():
            module = transformer.get_submodule(name)
            start = offsets.get(name, 0)
            end = offsets[name] = start + layer.rank
            slot_a, slot_b = module.lora_A["loraswap_slot"].weight, module.lora_B["loraswap_slot"].weight
            assert torch.equal(slot_a[start:end], layer.a), (adapter.name, name)
            assert torch.equal(slot_b[:, start:end], layer.b * scale), (adapter.name, name)


@pytest.mark.parametrize(
    ("dtype", "stale_magnitude"),
    [
        pytest.param(torch.float32, 3.0, id="float32"),
        # bfloat16: lora_B rows of rank 8 are copied as 16-byte elements, except where that member starts
        # after a rank-3 one (6 bytes in), which must fall back to element-wise copies (float32: rank 4 after 11).
        pytest.param(torch.bfloat16, 3.0, id="bfloat16"),
        pytest.param(torch.float16, 2000.0, id="float16-overflowing-stale-ranks"),
    ],
)
def test_stacks_then_single_then_base_match_a_fresh_slot_bit_for_bit(dtype, stale_magnitude):
    transformer, layers, slot, x, high = _stale_slot(dtype, stale_magnitude)
    half = len(layers) // 2
    # Overlapping on the middle layers only, ranks 3 + 8 + 4 + 1 = 16 where all four meet (placed in stack_order).
    odd = _named(_adapter(transformer, layers, 3, 0.1, dtype, seed=3), "a-odd", layers[half - 2 :])
    first = _named(_adapter(transformer, layers, 8, 0.1, dtype, seed=2), "b-eight", layers[: half + 2])
    fourth = _named(_adapter(transformer, layers, 4, 0.1, dtype, seed=4), "c-four")
    one = _named(_adapter(transformer, layers, 1, 0.1, dtype, seed=5), "d-one", layers[half - 1 : half + 1])
    sequence = [
        ((first, 0.7), (odd, 1.0)),
        ((odd, -1.5), (first, 1.0), (fourth, 0.5), (one, 2.0)),  # 16 on the middle layers: the limit
        ((fourth, 1.0), (one, 1.0)),
        ((first, 0.7),),  # a single adapter after stacks
        (),  # the base model after stacks
        ((odd, 1.0), (fourth, 0.5)),
    ]
    for members in sequence:
        _load(slot, high, 2.0)  # the stale values every case starts from
        slot.load_stack(members)
        fresh_transformer, _, fresh_slot = _denoiser_with_slot(dtype)  # never held anything else
        fresh_slot.load_stack(members)
        live, expected = _outputs(transformer, layers, x), _outputs(fresh_transformer, layers, x)
        for name in layers:
            assert torch.equal(live[name], expected[name]), ([m[0].name for m in members], name)
            assert torch.isfinite(live[name]).all(), ([m[0].name for m in members], name)
        _assert_slot_holds(transformer, members)
        assert gates_match_resident(slot.slot) and slot.holds(members)
        assert slot.resident_adapters == tuple(adapter for adapter, _ in stack_order(members))
        # Nothing was cleared: the ranks beyond the stack still hold the high-rank adapter's values.
        assert transformer.get_submodule(layers[-1]).lora_A["loraswap_slot"].weight[12:].abs().max() > 0
    # Some member's 16-byte lora_B source met a rank range that starts off a 16-byte boundary.
    assert any(copy.narrow for plan in slot.planner.cached_plans for copy in plan.copies)


def test_a_stack_equals_its_members_in_any_order_and_is_no_single_adapter():
    transformer, layers, slot = _denoiser_with_slot(torch.float32)
    a = _named(_adapter(transformer, layers, 4, 0.1, torch.float32, seed=1), "a")
    b = _named(_adapter(transformer, layers, 8, 0.1, torch.float32, seed=2), "b", layers[:5])
    x = {name: torch.randn(2, transformer.get_submodule(name).in_features) for name in layers}
    assert slot.load_stack([(b, 0.5), (a, 1.0)]) > 0
    in_one_order = _outputs(transformer, layers, x)
    assert slot.holds([(a, 1.0), (b, 0.5)]) and slot.load_stack([(a, 1.0), (b, 0.5)]) == 0.0
    assert not slot.holds([(a, 1.0), (b, 0.6)]) and not slot.holds([(a, 1.0)]) and not slot.holds([(a, 1.0)])
    assert slot.resident_members == ((a, 1.0), (b, 0.5))  # a stack, in name order
    _load(slot, None)
    slot.load_stack([(a, 1.0), (b, 0.5)])
    in_the_other = _outputs(transformer, layers, x)
    assert all(torch.equal(in_one_order[name], in_the_other[name]) for name in layers)
    # A one-member stack is the single adapter.
    slot.load_stack([(a, 0.5)])
    assert slot.resident_members == ((a, 0.5),) and slot.holds([(a, 0.5)])


def test_a_stack_over_max_rank_is_refused_before_anything_changes():
    transformer, layers, slot = _denoiser_with_slot(torch.float32)
    resident = _named(_adapter(transformer, layers, 4, 0.1, torch.float32, seed=1), "resident")
    big = _named(_adapter(transformer, layers, 12, 0.1, torch.float32, seed=2), "big")
    small = _named(_adapter(transformer, layers, 8, 0.1, torch.float32, seed=3), "small", [layers[2], layers[7]])
    _load(slot, resident, 0.5)
    x = {name: torch.randn(2, transformer.get_submodule(name).in_features) for name in layers}
    before = _outputs(transformer, layers, x)
    refusals = (lambda: check_stack_fits([big, small], MAX_RANK), lambda: slot.load_stack([(big, 1.0), (small, 1.0)]))
    for refuse in refusals:
        with pytest.raises(AdapterIncompatibleError) as caught:
            refuse()
        error = caught.value
        assert error.reason is ErrorReason.STACK_RANK_EXCEEDED
        # The worst layer (the first of the two at 20, by name), its summed rank and the limit.
        worst = min(layers[2], layers[7])
        assert error.metadata == {"layer": worst, "rank": "20", "max_rank": str(MAX_RANK)}
        assert f"add up to 20 on layer {worst}, above the server's max rank {MAX_RANK}" in error.message
    after = _outputs(transformer, layers, x)
    assert all(torch.equal(before[name], after[name]) for name in layers)
    assert slot.holds([(resident, 0.5)]) and gates_match_resident(slot.slot)
    check_stack_fits([resident, small], MAX_RANK)  # 4 + 8: fits


def test_a_stack_layout_builds_its_plan_once():
    transformer, layers, slot = _denoiser_with_slot(torch.float32)
    a = _named(_adapter(transformer, layers, 4, 0.1, torch.float32, seed=1), "a")
    b = _named(_adapter(transformer, layers, 8, 0.1, torch.float32, seed=2), "b")
    for members in ([(a, 1.0), (b, 1.0)], [(a, 1.0)], [(b, 0.5), (a, 2.0)], [], [(a, 1.0)]):
        slot.load_stack(members)
    assert len(slot.planner.cached_plans) == 2  # the stack (a, b) at any strengths, and a alone
    # Another adapter with a's layout (layers and ranks) and b's reuses the same plans.
    a2 = _named(_adapter(transformer, layers, 4, 0.2, torch.float32, seed=3), "a2")
    slot.load_stack([(a2, 1.0), (b, 1.0)])
    assert len(slot.planner.cached_plans) == 2
