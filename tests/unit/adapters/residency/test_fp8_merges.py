"""Fused merges into --quantize fp8 weights on the CPU: torchao's own quantization as the reference, bit for bit.

The weights are made by the server's own quantization (quantize_denoiser, torchao's Float8Tensor with per-tensor
scales). torchao refuses fp8 off a CUDA device of capability 8.9 in one assert before quantizing; its arithmetic
(Float8Tensor.from_hp) runs anywhere, so the tests lift that assert alone.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchao", reason="--quantize needs torchao, a dependency of loraswap-server")

from loraswap.server.engine.adapters.residency import (  # noqa: E402
    is_float8_weight,
    reference_fp8,
    scales_in_range,
    write_fp8,
)
from loraswap.server.engine.pipeline.quantization import quantize_denoiser  # noqa: E402

# (out, in) shapes of the layers; torchao quantizes only sides that are multiples of 16.
SHAPES = [(64, 48), (96, 160)]
RANK = 8


@pytest.fixture
def fp8_layers(monkeypatch) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """bfloat16 linear layers quantized by quantize_denoiser(..., "fp8"), and each layer's pristine W0."""
    import torchao.quantization.quant_api as quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    generator = torch.Generator().manual_seed(0)
    denoiser = torch.nn.Sequential(*(torch.nn.Linear(cols, rows, dtype=torch.bfloat16) for rows, cols in SHAPES))
    for layer in denoiser:
        layer.weight.data = (torch.randn(layer.weight.shape, generator=generator) * 0.05).to(torch.bfloat16)
    denoiser.requires_grad_(False)  # as start-up leaves every component
    pristine = [layer.weight.detach().clone() for layer in denoiser]
    quantize_denoiser(denoiser, "fp8")
    return denoiser, pristine


def merged_of(w0: torch.Tensor, strength: float, seed: int) -> torch.Tensor:
    """W0 + s B A accumulated in float32 (a rank-RANK change of W0's size)."""
    generator = torch.Generator().manual_seed(seed)
    b = torch.randn(w0.shape[0], RANK, generator=generator) * 0.1
    a = torch.randn(RANK, w0.shape[1], generator=generator) * 0.1
    return w0.float() + strength * (b @ a)


def bits(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return weight.qdata.view(torch.uint8).clone(), weight.scale.view(torch.int32).clone()


def same_bits(weight: torch.Tensor, expected: tuple[torch.Tensor, torch.Tensor]) -> bool:
    qdata, scale = expected
    if qdata.dtype != torch.uint8:
        qdata, scale = qdata.view(torch.uint8), scale.view(torch.int32)
    return torch.equal(weight.qdata.view(torch.uint8), qdata) and torch.equal(weight.scale.view(torch.int32), scale)


def test_start_up_stores_torchao_float8_tensors_with_one_scale(fp8_layers) -> None:
    denoiser, pristine = fp8_layers
    for layer, w0 in zip(denoiser, pristine, strict=True):
        weight = layer.weight
        assert is_float8_weight(weight) and not is_float8_weight(w0)
        assert weight.dtype == torch.bfloat16 and weight.qdata.dtype == torch.float8_e4m3fn
        assert weight.scale.shape == (1, 1) and weight.scale.dtype == torch.float32
        # The reference is what start-up made: an empty change writes start-up's bits back.
        assert same_bits(weight, reference_fp8(w0, weight))


@pytest.mark.parametrize("merged_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strength", [0.5, 1.0, 40.0])
def test_a_write_is_torchao_quantization_of_the_merge_bit_for_bit(fp8_layers, merged_dtype, strength) -> None:
    denoiser, pristine = fp8_layers
    for index, (layer, w0) in enumerate(zip(denoiser, pristine, strict=True)):
        merged = merged_of(w0, strength, seed=index)
        expected = reference_fp8(merged, layer.weight)
        write_fp8(layer.weight, merged.to(merged_dtype))
        assert same_bits(layer.weight, expected)
        if strength == 40.0:  # a change that outgrows W0 moves the scale
            assert not same_bits(layer.weight, reference_fp8(w0, layer.weight))
    assert bool(scales_in_range([layer.weight for layer in denoiser]).all())


def test_a_write_keeps_the_tensors_the_graphs_hold(fp8_layers) -> None:
    denoiser, pristine = fp8_layers
    layer, w0 = denoiser[1], pristine[1]
    weight = layer.weight
    held = (id(weight), id(weight.qdata), id(weight.scale), weight.qdata.data_ptr(), weight.scale.data_ptr())
    rounded = torch.empty(w0.numel() + 5, dtype=torch.bfloat16)
    write_fp8(weight, merged_of(w0, 3.0, seed=7), rounded)
    assert layer.weight is weight
    assert (id(weight), id(weight.qdata), id(weight.scale), weight.qdata.data_ptr(), weight.scale.data_ptr()) == held


def test_writes_from_the_pristine_copy_repeat_and_an_empty_change_restores_start_up(fp8_layers) -> None:
    denoiser, pristine = fp8_layers
    layer, w0 = denoiser[0], pristine[0]
    start_up = bits(layer.weight)
    write_fp8(layer.weight, merged_of(w0, 2.0, seed=1))
    first = bits(layer.weight)
    write_fp8(layer.weight, merged_of(w0, 25.0, seed=2))
    write_fp8(layer.weight, merged_of(w0, 2.0, seed=1))
    assert same_bits(layer.weight, first) and not same_bits(layer.weight, start_up)
    write_fp8(layer.weight, w0.float() + 0.0 * merged_of(w0, 1.0, seed=3))  # an all-zero change, in float32
    assert same_bits(layer.weight, start_up)
    write_fp8(layer.weight, merged_of(w0, 2.0, seed=1))
    write_fp8(layer.weight, w0)  # W0 itself, in the model's dtype
    assert same_bits(layer.weight, start_up)


@pytest.mark.parametrize(
    ("spoil", "in_range"),
    [
        (lambda merged: merged, True),
        (lambda merged: merged.index_fill_(0, torch.tensor([3]), float("inf")), False),
        (lambda merged: merged.index_fill_(1, torch.tensor([5]), float("nan")), False),
        (lambda merged: merged.zero_(), False),  # torchao quantizes an all-zero weight to NaN (0 / 0)
        (lambda merged: merged.fill_(torch.finfo(torch.float32).max), False),  # rounds to inf in bfloat16
    ],
    ids=["finite", "inf", "nan", "all-zero", "past-bfloat16"],
)
def test_scales_in_range_says_whether_a_write_holds_the_merge(fp8_layers, spoil, in_range) -> None:
    denoiser, pristine = fp8_layers
    merged = spoil(merged_of(pristine[0], 1.0, seed=4))
    write_fp8(denoiser[0].weight, merged)
    write_fp8(denoiser[1].weight, merged_of(pristine[1], 1.0, seed=5))
    assert scales_in_range([denoiser[0].weight, denoiser[1].weight]).tolist() == [in_range, True]


class _Recorder(TorchDispatchMode):
    """Every aten op called, with the tensors it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else [out]
        self.calls.append((str(func), [t for t in results if isinstance(t, torch.Tensor)]))
        return out


def test_a_write_allocates_nothing_of_the_layer_size_and_never_reads_the_device(fp8_layers) -> None:
    denoiser, pristine = fp8_layers
    weight, w0 = denoiser[1].weight, pristine[1]
    merged = merged_of(w0, 2.0, seed=6)
    rounded = torch.empty(w0.numel(), dtype=torch.bfloat16)
    allowed = {weight.qdata.data_ptr(), rounded.data_ptr(), merged.data_ptr()}
    with _Recorder() as recorder:
        write_fp8(weight, merged, rounded)
        scales_in_range([weight])
    names = [name for name, _ in recorder.calls]
    assert not [name for name in names if "_local_scalar_dense" in name or name.startswith("aten.item")]
    large = [(name, t.data_ptr()) for name, outs in recorder.calls for t in outs if t.numel() > 1]
    assert large and all(pointer in allowed for _, pointer in large), large
    assert sum("div" in name for name, _ in recorder.calls if any(t.numel() > 1 for t in _)) == 1  # one pass


def test_a_compiled_layer_reads_the_written_weight_without_recompiling(fp8_layers) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    denoiser, pristine = fp8_layers
    layer, w0 = denoiser[0], pristine[0]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter)
    x = torch.randn(4, w0.shape[1], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(9))
    before = compiled(x)
    write_fp8(layer.weight, merged_of(w0, 30.0, seed=8))
    after = compiled(x)
    assert counter.frame_count == 1
    assert torch.equal(after, layer(x)) and not torch.equal(after, before)


@pytest.mark.parametrize("quantization", ["int8wo", "fp8"])
def test_quantizing_leaves_inductor_tuning_to_compile_mode(fp8_layers, quantization) -> None:
    """torchao's recommended inductor settings (coordinate-descent tuning of every kernel) made fp8 start-ups
    host-bound for minutes; the server's quantization leaves inductor's configuration as it was."""
    import torch._inductor.config as inductor_config

    denoiser = torch.nn.Sequential(torch.nn.Linear(32, 32, dtype=torch.bfloat16))
    before = (inductor_config.coordinate_descent_tuning, inductor_config.coordinate_descent_check_all_directions)
    quantize_denoiser(denoiser, quantization)
    assert type(denoiser[0].weight) is not torch.nn.Parameter  # quantized
    assert (inductor_config.coordinate_descent_tuning, inductor_config.coordinate_descent_check_all_directions) == (
        before
    )
    assert before == (False, False)


def test_write_refuses_what_it_cannot_write(fp8_layers) -> None:
    denoiser, pristine = fp8_layers
    with pytest.raises(ValueError, match="per-tensor torchao float8"):
        write_fp8(pristine[0], pristine[0])
    with pytest.raises(ValueError, match="cannot be written"):
        write_fp8(denoiser[0].weight, pristine[1])
    with pytest.raises(ValueError, match="cannot be written"):
        write_fp8(denoiser[0].weight, pristine[0].half())
