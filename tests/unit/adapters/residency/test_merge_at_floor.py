"""A fused merge at its floor (adapters/residency/fused.py): per layer one product from the pristine copy into the weight, no
host sync, on the CPU as on a GPU (the same code; the device only changes where the tensors live).

Counted with a dispatch mode over every op the merge runs: the kernels each layer costs (views and other metadata
ops launch none) and every read of a value back to the host. Images and bits: the merge equals W0 + s B A summed
in float32 and rounded once, the same bits on every repeat; on float8 weights it equals torchao's own quantization
of that, and a restore gives start-up's bits back.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer, slot_effect
from loraswap.server.engine.adapters.residency import FusedWeights
from loraswap.server.engine.errors import InvalidRequestError

# Ops that launch no kernel: views, shape and metadata.
METADATA_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute", "aten.slice",
    "aten.select", "aten.expand", "aten.as_strided", "aten.detach", "aten.alias", "aten.unsqueeze", "aten.squeeze",
    "aten.split", "aten.narrow", "aten.empty", "aten.empty_strided", "aten.lift_fresh",
})  # fmt: skip
# Ops whose answer comes back to the host: each one waits for the device.
READ_OPS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.nonzero"})
SHAPES = {"to_q": (96, 64), "to_k": (96, 64), "ff": (256, 96)}  # name -> (out, in)
RANK = 8


class OpCounter(TorchDispatchMode):
    """Every op dispatched while inside, by name (overload dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        return sum(count for op, count in self.ops.items() if op not in METADATA_OPS)

    @property
    def reads(self) -> int:
        return sum(count for op, count in self.ops.items() if op in READ_OPS)


def _layers(dtype=torch.bfloat16) -> dict[str, torch.nn.Linear]:
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for name, (out_features, in_features) in SHAPES.items():
        layer = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype).requires_grad_(False)
        layer.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.05)
        layers[name] = layer
    return layers


def _adapter(name: str, seed: int, dtype=torch.bfloat16, value: float | None = None) -> CanonicalAdapter:
    """A rank-RANK LoRA on every layer, with its effects measured as a load measures them."""
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for module, (out_features, in_features) in SHAPES.items():
        a, b = (torch.randn(shape, generator=generator) * 0.1 for shape in ((RANK, in_features), (out_features, RANK)))
        if value is not None:
            a, b = torch.full_like(a, value), torch.full_like(b, value)
        layers[module] = CanonicalLayer(a=a.to(dtype), b=b.to(dtype))
    effects = {
        ("denoiser", module): slot_effect(layer.a, layer.b, None, None, dtype) for module, layer in layers.items()
    }
    return CanonicalAdapter(name=name, source="test", warnings=(), load_ms=0.0, layers=layers, effects=effects)


def test_a_merge_is_one_product_per_layer_and_waits_for_nothing() -> None:
    fused = FusedWeights.over_layers("denoiser", _layers())
    adapters = [_adapter("a", 1), _adapter("b", 2)]
    fused.merge(((adapters[0], 0.8),))  # scratch and first-use costs out of the way
    with OpCounter() as counter:
        fused.merge(((adapters[1], 0.6),))
    assert counter.reads == 0, counter.ops
    assert counter.ops["aten.addmm"] == len(SHAPES), counter.ops
    assert counter.kernels <= 2 * len(SHAPES), counter.ops
    # Back to the base model: one copy per layer, no read either.
    with OpCounter() as counter:
        fused.merge(())
    assert counter.reads == 0 and counter.kernels <= len(SHAPES), counter.ops


def test_the_merge_is_the_float32_sum_rounded_once_with_the_same_bits_every_time() -> None:
    layers = _layers()
    w0 = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    fused = FusedWeights.over_layers("denoiser", layers)
    adapter, other = _adapter("a", 3), _adapter("b", 4)
    fused.merge(((adapter, -1.7),))
    first = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    for name, factors in adapter.layers.items():
        reference = torch.addmm(w0[name].float(), factors.b.float(), factors.a.float(), alpha=-1.7)
        ulp = torch.finfo(torch.bfloat16).eps * reference.abs()
        assert bool(((first[name].float() - reference).abs() <= ulp).all())
    fused.merge(((other, 1.0),))
    fused.merge(((adapter, -1.7),))
    assert all(torch.equal(layers[name].weight, first[name]) for name in SHAPES)
    fused.merge(())
    assert all(torch.equal(layers[name].weight, w0[name]) for name in SHAPES)


def test_a_merge_whose_bound_reaches_the_dtype_is_checked_and_refused_with_what_fits() -> None:
    """Where W0's largest value and the change's reach bfloat16's largest value, the result is checked (one read)
    and an overflow is refused, naming the strengths that fit; W0 stays everywhere."""
    layers = _layers()
    with torch.no_grad():
        layers["ff"].weight[0, 0] = 3.0e38
    w0 = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    fused = FusedWeights.over_layers("denoiser", layers)
    huge = _adapter("huge", 5, value=1e18)  # B A = 8e36 everywhere, 6.4e37 at strength 8: past 3.39e38 beside 3e38
    with pytest.raises(InvalidRequestError) as refused, OpCounter() as counter:
        fused.merge(((huge, 8.0),))
    assert refused.value.reason == "ADAPTER_OUT_OF_RANGE" and refused.value.metadata["layer"] == "ff"
    assert "strengths up to" in refused.value.message
    assert counter.reads >= 1
    assert all(torch.equal(layers[name].weight, w0[name]) for name in SHAPES)


@pytest.fixture
def fp8_layers(monkeypatch):
    """bfloat16 layers, a writer whose pristine copies were taken before --quantize fp8 (as start-up takes them),
    then the layers quantized by the server's own quantize_denoiser (torchao's CUDA-only assert lifted)."""
    pytest.importorskip("torchao", reason="--quantize needs torchao, a dependency of loraswap-server")
    from torchao.quantization import quant_api

    from loraswap.server.engine.pipeline.quantization import quantize_denoiser

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    layers = _layers()
    fused = FusedWeights.over_layers("denoiser", layers)
    quantize_denoiser(torch.nn.ModuleDict(layers), "fp8")
    return layers, fused


def test_a_fused_merge_into_float8_weights_is_torchaos_quantization_of_the_merge(fp8_layers) -> None:
    from loraswap.server.engine.adapters.residency import is_float8_weight, reference_fp8

    layers, fused = fp8_layers
    assert all(is_float8_weight(layer.weight) for layer in layers.values())
    started = {name: (layer.weight.qdata.clone(), layer.weight.scale.clone()) for name, layer in layers.items()}
    addresses = {name: (layer.weight.qdata.data_ptr(), layer.weight.scale.data_ptr()) for name, layer in layers.items()}
    adapter = _adapter("a", 6)
    with OpCounter() as counter:
        fused.merge(((adapter, 0.9),))
    assert counter.reads == 0, counter.ops
    for name, layer in layers.items():
        w0 = fused.pristine.weights["denoiser", name]
        factors = adapter.layers[name]
        qdata, scale = reference_fp8(torch.addmm(w0, factors.b, factors.a, alpha=0.9), layer.weight)
        assert torch.equal(layer.weight.qdata.view(torch.uint8), qdata.view(torch.uint8))
        assert torch.equal(layer.weight.scale, scale)
        assert (layer.weight.qdata.data_ptr(), layer.weight.scale.data_ptr()) == addresses[name]
    fused.merge(())
    for name, layer in layers.items():
        assert torch.equal(layer.weight.qdata.view(torch.uint8), started[name][0].view(torch.uint8))
        assert torch.equal(layer.weight.scale, started[name][1])
