"""How far a change moves a layer (adapters/formats/change_effects.py): bounds that hold, exact figures where the range is near,
figures past float32 measured all the same, and the refusals' numbers.

Every reference is the dense ΔW formed here in float64 from the factors, as LyCORIS and PEFT define each kind.
"""

from __future__ import annotations

import math

import pytest
import torch

from loraswap.server.engine.adapters.formats import (
    Full,
    Hadamard,
    Kronecker,
    LayerChange,
    LowRank,
    effect_limit,
    largest_fitting_strength,
    layer_effect,
    refuse_out_of_range,
    refuse_strengths,
    slot_effect,
)
from loraswap.server.engine.errors import AdapterFormatError, InvalidRequestError

F32 = torch.float32


def _random(*shape, scale=0.1, seed=0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _dense_lora(up, down, gamma=1.0) -> float:
    return float((up.double() @ down.double()).abs().max()) * abs(gamma)


def _dense_loha(w1a, w1b, w2a, w2b, gamma) -> float:
    return float(((w1a.double() @ w1b.double()) * (w2a.double() @ w2b.double())).abs().max()) * abs(gamma)


def test_a_trained_lora_gets_a_bound_that_holds_and_is_within_its_rank_of_exact() -> None:
    up, down = _random(48, 8, seed=1), _random(8, 32, seed=2)
    exact = _dense_lora(up, down, 0.5)
    bound = layer_effect(LayerChange(LowRank(down, up, None, 0.5)), (48, 32), F32)
    assert exact <= bound <= 8 * exact


def test_near_the_range_the_figure_is_exact() -> None:
    # A bound of rank x max|B| max|A| at 1e9 each would pass float16's range; the exact figure is formed instead.
    up, down = _random(48, 8, seed=3), _random(8, 32, seed=4)
    change = LayerChange(LowRank(down, up, None, 1e4))
    assert layer_effect(change, (48, 32), torch.float16) == pytest.approx(_dense_lora(up, down, 1e4), rel=1e-5)


@pytest.mark.parametrize("value", [1e20, 1e30])
def test_factors_past_float32_are_measured_all_the_same(value: float) -> None:
    up, down = torch.full((48, 4), value), torch.full((4, 32), value)
    effect = slot_effect(down, up, None, None, F32)
    assert effect == pytest.approx(4 * value * value, rel=1e-5)  # 4e40 and 4e60: past float32, not inf


def test_a_loha_of_1e20_and_a_float64_loha_of_1e300() -> None:
    w1a, w1b, w2a, w2b = (torch.full(shape, 1e20) for shape in ((48, 4), (4, 32), (48, 4), (4, 32)))
    loha = LayerChange(Hadamard(w1a, w1b, w2a, w2b, None, None, 0.5))
    assert layer_effect(loha, (48, 32), F32) == pytest.approx(_dense_loha(w1a, w1b, w2a, w2b, 0.5), rel=1e-5)
    huge = [torch.full(t.shape, 1e300, dtype=torch.float64) for t in (w1a, w1b, w2a, w2b)]
    assert layer_effect(LayerChange(Hadamard(*huge, None, None, 1.0)), (48, 32), F32) == math.inf


def test_a_lokr_is_exact_from_its_sides() -> None:
    w1, w2a, w2b = _random(4, 2, seed=5), _random(12, 3, seed=6), _random(3, 16, seed=7)
    change = LayerChange(Kronecker(w1, None, None, None, w2a, w2b, None, 0.25))
    dense = torch.kron(w1.double(), w2a.double() @ w2b.double()) * 0.25
    assert layer_effect(change, (48, 32), F32) == pytest.approx(float(dense.abs().max()), rel=1e-9)


def test_a_bias_and_a_magnitude_count() -> None:
    diff = _random(48, 32, seed=8)
    bias = torch.full((48,), 7.0)
    assert layer_effect(LayerChange(Full(diff), bias), (48, 32), F32) == 7.0
    magnitude = torch.full((48, 1), 3.0)
    with_dora = layer_effect(LayerChange(Full(diff), None, magnitude), (48, 32), F32)
    assert with_dora == pytest.approx(float(diff.abs().max()) + 3.0)


def test_the_largest_fitting_strength_is_rounded_down_and_none_when_nothing_fits() -> None:
    limit = effect_limit(F32)
    assert limit == pytest.approx(math.sqrt(torch.finfo(F32).max))
    fit = largest_fitting_strength(limit / 2.987654, limit)
    assert fit == 2.98 and fit * (limit / 2.987654) <= limit
    assert largest_fitting_strength(1e81, limit) is None  # 1.8e-62: no float32 strength is that small
    assert largest_fitting_strength(math.inf, limit) is None


def test_a_load_past_the_range_is_refused_with_the_layer_and_what_would_fit() -> None:
    limit = effect_limit(F32)
    refuse_out_of_range({("unet", "a"): limit, ("unet", "b"): 1.0}, F32)  # at the range: served
    with pytest.raises(AdapterFormatError) as refused:
        refuse_out_of_range({("unet", "a"): 1.0, ("unet", "b"): 4 * limit}, F32)
    error = refused.value
    assert error.reason == "ADAPTER_OUT_OF_RANGE" and error.metadata == {"layer": "b", "max_scale": "0.25"}
    assert "layer b of the unet" in error.message and "up to 0.25" in error.message
    with pytest.raises(AdapterFormatError) as hopeless:
        refuse_out_of_range({("unet", "a"): 1e81}, F32)
    assert "max_scale" not in hopeless.value.metadata and "no strength" in hopeless.value.message


def test_a_strength_past_the_range_is_refused_with_the_strengths_that_fit() -> None:
    limit = effect_limit(F32)
    effects = {("unet", "a"): limit / 3}
    refuse_strengths([(effects, 3.0)], F32)
    refuse_strengths([(effects, -3.0)], F32)
    with pytest.raises(InvalidRequestError) as single:
        refuse_strengths([(effects, -8.0)], F32)
    assert single.value.reason == "ADAPTER_OUT_OF_RANGE"
    assert single.value.metadata == {"field": "adapter_scale", "layer": "a", "max_scale": "3"}
    assert "strengths up to 3 fit" in single.value.message and "stays cached" in single.value.message
    # A stack adds its members' changes on each layer they share.
    with pytest.raises(InvalidRequestError) as stack:
        refuse_strengths([(effects, 2.0), ({("unet", "a"): limit / 3, ("unet", "c"): 1.0}, 2.0)], F32)
    assert stack.value.metadata["field"] == "adapters" and stack.value.metadata["max_scale"] == "0.75"


def test_a_loha_whose_products_pass_the_range_is_refused_however_small_its_change() -> None:
    """1e30-sized products times 1e-40-sized ones: ΔW is tiny, but a merge forms each product first."""
    from loraswap.server.engine.adapters.formats import formed_on_the_way

    big, tiny = torch.full((48, 1), 1e15), torch.full((48, 1), 1e-20)
    loha = LayerChange(Hadamard(big, big.T.contiguous()[:, :32], tiny, tiny.T.contiguous()[:, :32], None, None, 1.0))
    effect = layer_effect(loha, (48, 32), F32)
    assert effect == pytest.approx(1e30 * 1e-40, rel=1e-5) and effect < effect_limit(F32)
    on_the_way = formed_on_the_way(loha)
    assert on_the_way == pytest.approx(1e30, rel=1e-5)
    with pytest.raises(AdapterFormatError) as refused:
        refuse_out_of_range({("unet", "x"): effect}, F32, {("unet", "x"): on_the_way})
    assert refused.value.reason == "ADAPTER_OUT_OF_RANGE" and "LoHa product" in refused.value.message


def test_a_converters_failure_is_told_in_our_words_not_torchs() -> None:
    from loraswap.server.engine.adapters.formats import converter_said

    torch_text = "shape '[3, -1]' is invalid for input of size 7"
    assert torch_text not in converter_said(RuntimeError(torch_text))
    assert "RuntimeError" in converter_said(RuntimeError(torch_text))
    assert "'lora_unet_x.alpha'" in converter_said(KeyError("lora_unet_x.alpha"))
    assert "Incompatible keys" in converter_said(ValueError("Incompatible keys detected: x"))
