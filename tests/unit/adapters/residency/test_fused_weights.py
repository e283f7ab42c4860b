"""Fused swaps on a real tiny-flux runtime: PEFT's own merge arithmetic as the reference, exact repeats, restores.

The adapters are written by PEFT (plain, DoRA, a trained lora_B bias, a rank above the slot's); the reference is
a fresh diffusers pipeline with the same file loaded by `load_lora_weights` and merged by `fuse_lora`.
"""

from __future__ import annotations

import pytest
import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer, load_canonical
from loraswap.server.engine.adapters.sources import LocalAdapterDirectory
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import InvalidRequestError, StartupError
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.startup import start_runtime
from tests.support.adapters import write_random_adapters
from tests.support.slots import holds_pristine

MAX_RANK = 16
# name -> write_random_adapter keywords
ADAPTERS = {
    "plain": dict(rank=4, alpha=8.0, target_modules=("to_q", "to_k", "to_v", "to_out.0"), seed=1),
    "mlp": dict(rank=8, alpha=8.0, target_modules=("ff.net.0.proj", "ff.net.2", "proj_mlp", "to_v"), seed=2),
    "dora": dict(rank=4, alpha=4.0, target_modules=("to_q", "to_v", "proj_out"), seed=3, use_dora=True),
    "bias": dict(rank=4, alpha=4.0, target_modules=("to_k", "ff.net.2"), seed=4, lora_bias=True),
    "wide": dict(rank=2 * MAX_RANK, alpha=32.0, target_modules=("to_q", "to_out.0"), seed=5),
}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return write_random_adapters("tiny-flux", tmp_path_factory.mktemp("fused-adapters"), ADAPTERS, init_std=0.3)


@pytest.fixture(scope="module")
def runtime():
    return start_runtime(
        EngineConfig(model="tiny-flux", max_rank=MAX_RANK, compile=False, warmup=False, torch_threads=1, fuse="always")
    )


@pytest.fixture(scope="module")
def adapters(runtime, adapter_dir) -> dict[str, CanonicalAdapter]:
    directory = LocalAdapterDirectory(adapter_dir)
    return {name: load_canonical(directory.find(name), runtime.slot_spec()) for name in ADAPTERS}


def _base_weights(denoiser: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    weights = {}
    for name in names:
        layer = denoiser.get_submodule(name)
        base = getattr(layer, "base_layer", layer)
        weights[name] = base.weight.detach().clone()
        if base.bias is not None:
            weights[name + ".bias"] = base.bias.detach().clone()
    return weights


def _peft_merged(adapter_dir, name: str, scale: float, layers) -> dict[str, torch.Tensor]:
    """The base weights after diffusers' load_lora_weights + fuse_lora (PEFT's merge) on a fresh pipeline."""
    pipe = builtin_model("tiny-flux").build()
    pipe.load_lora_weights(str(adapter_dir / name))
    pipe.fuse_lora(lora_scale=scale)
    return _base_weights(pipe.transformer, layers)


@pytest.mark.parametrize(("name", "scale"), [("plain", 1.0), ("plain", -0.7), ("mlp", 1.6), ("dora", 1.0),
                                             ("dora", 0.5), ("bias", 0.8), ("wide", 1.0)])  # fmt: skip
def test_a_fused_adapter_writes_what_peft_merges(runtime, adapters, adapter_dir, name, scale) -> None:
    fused = runtime.residency.fused_weights
    adapter = adapters[name]
    assert adapter.fits_slot is (name in ("plain", "mlp"))
    fused.merge(((adapter, scale),))
    try:
        ours = _base_weights(runtime.denoiser, list(runtime.residency.slot.layers))
    finally:
        fused.restore()
    expected = _peft_merged(adapter_dir, name, scale, list(runtime.residency.slot.layers))
    assert ours.keys() == expected.keys()
    pristine = {name: weight for (_, name), weight in fused.pristine.weights.items()}
    changed = [key for key in ours if not torch.equal(expected[key], pristine.get(key, expected[key]))]
    assert changed, "the adapter must change some base weights"
    for key, weight in ours.items():
        torch.testing.assert_close(weight, expected[key], rtol=1e-5, atol=1e-6, msg=key)
    assert holds_pristine(fused)


def test_a_stack_fuses_as_the_sum_of_its_members(runtime, adapters) -> None:
    fused = runtime.residency.fused_weights
    members = ((adapters["plain"], 0.5), (adapters["mlp"], -1.2), (adapters["wide"], 0.8))
    fused.merge(members)
    stacked = _base_weights(runtime.denoiser, list(runtime.residency.slot.layers))
    for name, weight in stacked.items():
        if name.endswith(".bias"):
            continue
        expected = fused.pristine.weights["transformer", name].clone()
        for adapter, scale in members:
            layer = adapter.layers.get(name)
            if layer is not None:
                expected += scale * layer.b.float() @ layer.a.float()
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6)
    fused.restore()
    assert holds_pristine(fused)


def test_every_merge_starts_from_the_pristine_weights_so_repeats_are_bit_identical(runtime, adapters) -> None:
    fused = runtime.residency.fused_weights
    layers = list(runtime.residency.slot.layers)
    fused.merge(((adapters["dora"], 0.9),))
    first = _base_weights(runtime.denoiser, layers)
    sequence = [
        ((adapters["plain"], 1.0),), ((adapters["bias"], 0.3), (adapters["mlp"], 1.0)), ((adapters["wide"], 1.0),),
        (), ((adapters["dora"], 0.5),), ((adapters["plain"], 2.0), (adapters["dora"], 0.9)),
    ]  # fmt: skip
    for _ in range(3):
        for members in sequence:
            fused.merge(members)
    fused.merge(((adapters["dora"], 0.9),))
    again = _base_weights(runtime.denoiser, layers)
    assert all(torch.equal(first[key], again[key]) for key in first)
    # A merge touches only its own layers' weights: the previous ones are restored, the rest never written.
    assert fused.touched == frozenset(("transformer", name) for name in adapters["dora"].layers)
    fused.restore()
    assert holds_pristine(fused)


def test_a_layer_merged_again_without_its_bias_change_gets_its_pristine_bias_back(runtime, adapters) -> None:
    """A stack that keeps a layer but not its bias change must not keep the previous merge's bias."""
    fused = runtime.residency.fused_weights
    key = ("transformer", "transformer_blocks.0.attn.to_k")  # the bias adapter trains its lora_B bias
    pristine = fused.pristine.biases[key].clone()
    fused.merge(((adapters["bias"], 1.0),))
    assert not torch.equal(fused.pristine.layers[key].bias, pristine)
    fused.merge(((adapters["plain"], 1.0),))  # to_k again, no bias change
    assert torch.equal(fused.pristine.layers[key].bias, pristine)
    fused.restore()
    assert holds_pristine(fused)


def _float16_runtime(fuse: str):
    return start_runtime(
        EngineConfig(model="tiny-flux", dtype="float16", max_rank=4, compile=False, warmup=False, torch_threads=1,
                     fuse=fuse)
    )  # fmt: skip


def _constant_adapter(runtime, name: str, value: float) -> CanonicalAdapter:
    """Rank 4 on the slot's last layer, every factor value `value` (3000: each factor fits float16, and lora_B at
    the largest strength, but their product does not)."""
    layer_name = list(runtime.residency.slot.layers)[-1]
    layer = runtime.residency.slot.base_layers()[layer_name]
    a = torch.full((4, layer.in_features), value, dtype=torch.float16)
    b = torch.full((layer.out_features, 4), value, dtype=torch.float16)
    return CanonicalAdapter(
        name=name, source="test", warnings=(), load_ms=0.0, layers={layer_name: CanonicalLayer(a=a, b=b)}
    )


def test_a_merge_that_overflows_is_refused_and_leaves_the_pristine_weights() -> None:
    runtime = _float16_runtime("always")
    fused = runtime.residency.fused_weights
    huge, small = _constant_adapter(runtime, "huge", 3000.0), _constant_adapter(runtime, "small", 0.01)
    fused.merge(((small, 1.0),))
    with pytest.raises(InvalidRequestError) as refused:
        fused.merge(((huge, 1.0),))
    assert refused.value.reason == "ADAPTER_OUT_OF_RANGE" and "adapter_scale" in refused.value.message
    assert holds_pristine(fused) and fused.touched == frozenset()


def test_under_auto_a_stack_whose_merge_overflows_runs_unfused_every_time() -> None:
    """auto fuses only as the cheaper way: where the merge cannot be held but the slot can hold the adapter, the
    request runs unfused, as under never (here its output overflows too: the unfused refusal, GENERATION_NOT_FINITE),
    and again the next time: whether a merge overflows is the stack's own property."""
    from loraswap.server.engine.types import GenerationRequest

    runtime = _float16_runtime("auto")
    huge = _constant_adapter(runtime, "huge", 3000.0)
    params = runtime.request_rules.resolve(GenerationRequest(prompt="a red circle", seed=1, num_inference_steps=2))
    stack = ((huge, 1.0),)
    swaps: list[bool] = []
    with pytest.raises(InvalidRequestError) as refused:
        runtime.generate(params, stack, on_step=lambda progress: None, is_cancelled=lambda: False, fused=True,
                         on_swap=lambda ms, fused: swaps.append(fused))  # fmt: skip
    assert refused.value.reason == "GENERATION_NOT_FINITE", refused.value
    assert swaps == [False] and not runtime.residency.fused and holds_pristine(runtime.residency.fused_weights)
    with pytest.raises(InvalidRequestError) as again:
        runtime.generate(params, stack, on_step=lambda progress: None, is_cancelled=lambda: False, fused=True,
                         on_swap=lambda ms, fused: swaps.append(fused))  # fmt: skip
    assert again.value.reason == "GENERATION_NOT_FINITE"
    assert swaps == [False, False] and holds_pristine(runtime.residency.fused_weights)


def test_the_slot_serves_fused_and_unfused_in_any_order_with_the_same_bits(runtime, adapters) -> None:
    """Through the slot: an adapter fused, unfused and fused again, with the base model and stacks between."""
    from loraswap.server.engine.types import GenerationRequest

    params = runtime.request_rules.resolve(GenerationRequest(prompt="a lighthouse", seed=5, num_inference_steps=2))

    def image(stack, fused):
        return runtime.generate(params, stack, on_step=lambda _: None, is_cancelled=lambda: False, fused=fused)

    plain = ((adapters["plain"], 0.8),)
    first_fused, first_unfused = image(plain, True), image(plain, False)
    base = image((), False)
    assert first_fused.fused and not first_unfused.fused and not base.fused
    dora = ((adapters["dora"], 1.0),)
    stack = ((adapters["mlp"], 1.0), (adapters["plain"], 1.0))
    for members, fused in [(dora, True), (plain, False), ((), False), (stack, True), (plain, True), (stack, False)]:
        image(members, fused)
    assert image(plain, True).data == first_fused.data
    assert image(plain, False).data == first_unfused.data
    assert image((), False).data == base.data
    assert holds_pristine(runtime.residency.fused_weights)


def test_pristine_copies_past_the_budget_are_refused_at_start_up_in_one_line() -> None:
    with pytest.raises(StartupError) as refused:
        start_runtime(
            EngineConfig(model="tiny-flux", max_rank=4, compile=False, warmup=False, torch_threads=1, fuse="auto",
                         fuse_memory_bytes=1000)
        )  # fmt: skip
    message = str(refused.value)
    assert "--fuse-memory-bytes" in message and "--fuse never" in message and "\n" not in message


def test_no_pristine_copies_without_fusing() -> None:
    for config in (EngineConfig(model="tiny-flux", fuse="never"), EngineConfig(model="tiny-flux", quantize="int8wo")):
        runtime = start_runtime(EngineConfig(**{**config.__dict__, "compile": False, "warmup": False}))
        assert runtime.residency.fused_weights is None and runtime.snapshot.facts.fuse_pristine_bytes == 0
        assert not runtime.slot_spec().fuse


def test_a_layer_larger_than_the_cpu_block_merges_block_by_block_to_the_whole_layer_bits() -> None:
    """Rows do not mix in a merge: a layer merged in row blocks (CPU_SCRATCH_ELEMENTS) holds the bits of one
    addmm over the whole layer (the CPU's bfloat16 product accumulates in float32 and rounds once), blocks of
    uneven size included; and that is W0 + s B A in float32 rounded once, to within one rounding."""
    from loraswap.server.engine.adapters.residency import CPU_SCRATCH_ELEMENTS, FusedWeights

    torch.manual_seed(0)
    layer = torch.nn.Linear(1000, 1049, bias=False).to(torch.bfloat16)  # 1049 rows of 1000: 3 blocks, the last short
    assert layer.weight.numel() > 2 * CPU_SCRATCH_ELEMENTS
    w0 = layer.weight.detach().clone()
    b, a = torch.randn(1049, 8, dtype=torch.bfloat16) * 0.05, torch.randn(8, 1000, dtype=torch.bfloat16) * 0.05
    adapter = CanonicalAdapter(
        name="big", source="test", warnings=(), load_ms=0.0, layers={"big": CanonicalLayer(a=a, b=b)}
    )
    fused = FusedWeights.over_layers("denoiser", {"big": layer})
    fused.merge(((adapter, 0.75),))
    assert torch.equal(layer.weight, torch.addmm(w0, b, a, alpha=0.75))
    in_float32 = torch.addmm(w0.float(), b.float(), a.float(), alpha=0.75)
    ulp = torch.finfo(torch.bfloat16).eps * in_float32.abs()
    assert bool(((layer.weight.float() - in_float32).abs() <= ulp).all())
    fused.merge(())
    assert torch.equal(layer.weight, w0)


def _kind_changes(out_features: int, in_features: int, generator: torch.Generator) -> dict[str, object]:
    from loraswap.server.engine.adapters.formats import Full, Hadamard, Kronecker, LayerChange, LowRank

    def draw(*shape):
        return torch.randn(*shape, generator=generator) * 0.05

    magnitude = 1 + 0.1 * draw(out_features, 1)
    return {
        "lora": LayerChange(LowRank(draw(6, in_features), draw(out_features, 6), None, 0.5)),
        "loha": LayerChange(Hadamard(draw(out_features, 4), draw(4, in_features), draw(out_features, 4),
                                     draw(4, in_features), None, None, 2.0)),
        # w2 of 21 rows (a period that divides no block size of the CPU's scratch), decomposed and whole.
        "lokr": LayerChange(Kronecker(draw(out_features // 21, 8), None, None, None, draw(21, 4),
                                      draw(4, in_features // 8), None, 1.5)),
        "lokr-whole": LayerChange(Kronecker(draw(out_features // 21, 8), None, None, draw(21, in_features // 8),
                                            None, None, None, 1.0)),
        "full": LayerChange(Full(draw(out_features, in_features))),
        "loha+dora": LayerChange(Hadamard(draw(out_features, 4), draw(4, in_features), draw(out_features, 4),
                                          draw(4, in_features), None, None, 1.0), None, magnitude, 1e-6),
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "lokr-whole", "full", "loha+dora"])
def test_every_kind_merged_in_row_blocks_equals_its_whole_layer_merge(kind: str) -> None:
    """A layer of several CPU blocks: each kind's rows formed block by block (LoKr's in whole periods of w2's rows)
    give what its whole-layer ΔW gives (add_to), beside a plain LoRA of the slot in the same merge."""
    from loraswap.server.engine.adapters.residency import CPU_SCRATCH_ELEMENTS, FusedWeights

    generator = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(1000, 1050, bias=False)  # 1050 rows of 1000: 3 blocks
    assert layer.weight.numel() > 2 * CPU_SCRATCH_ELEMENTS
    w0 = layer.weight.detach().clone()
    change = _kind_changes(1050, 1000, generator)[kind]
    b, a = torch.randn(1050, 4, generator=generator) * 0.05, torch.randn(4, 1000, generator=generator) * 0.05
    slot = CanonicalAdapter(name="slot", source="test", warnings=(), load_ms=0.0, layers={"big": CanonicalLayer(a, b)})
    lycoris = CanonicalAdapter(name=kind, source="test", warnings=(), load_ms=0.0, layers={}, fits_slot=False,
                               changes={("denoiser", "big"): change})  # fmt: skip
    fused = FusedWeights.over_layers("denoiser", {"big": layer})
    fused.merge(((slot, 0.5), (lycoris, 0.8)))
    whole = torch.addmm(w0, b * 0.5, a)
    change.add_to(whole, w0, 0.8)
    torch.testing.assert_close(layer.weight, whole, rtol=1e-5, atol=1e-6)
    fused.merge(())
    assert torch.equal(layer.weight, w0)


def test_a_bfloat16_merge_that_could_overflow_is_checked_and_refused() -> None:
    """One addmm merges a bfloat16 layer with no finiteness pass only while the factors' bound says nothing can
    overflow; factors past it are checked block by block, and an overflowing merge is refused as before."""
    from loraswap.server.engine.adapters.residency import FusedWeights

    layer = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    w0 = layer.weight.detach().clone()
    huge = CanonicalAdapter(name="huge", source="test", warnings=(), load_ms=0.0, layers={"big": CanonicalLayer(
        a=torch.full((4, 64), 1e30, dtype=torch.bfloat16), b=torch.full((48, 4), 1e30, dtype=torch.bfloat16))})  # fmt: skip
    fused = FusedWeights.over_layers("denoiser", {"big": layer})
    with pytest.raises(InvalidRequestError) as refused:
        fused.merge(((huge, 1.0),))
    assert refused.value.reason == "ADAPTER_OUT_OF_RANGE"
    assert torch.equal(layer.weight, w0)


def _own_dtype_changes(dtype: torch.dtype, generator: torch.Generator) -> dict[str, tuple[object, tuple[int, ...]]]:
    """name -> (LayerChange, the layer's weight shape): LoHa and LoKr on a linear layer of several LoHa blocks
    and on a 3x3 conv, in `dtype`."""
    from loraswap.server.engine.adapters.formats import Hadamard, Kronecker, LayerChange

    def draw(*shape):
        return (torch.randn(*shape, generator=generator) * 0.15).to(dtype)

    linear, conv = (2100, 2000), (48, 40, 3, 3)
    return {
        "loha": (LayerChange(Hadamard(draw(2100, 4), draw(4, 2000), draw(2100, 4), draw(4, 2000), None, None, 2.0),
                             bias=draw(2100)), linear),
        "lokr": (LayerChange(Kronecker(draw(100, 8), None, None, None, draw(21, 4), draw(4, 250), None, 1.5)), linear),
        "lokr-whole-w1-decomposed": (LayerChange(Kronecker(None, draw(100, 2), draw(2, 8), draw(21, 250), None, None,
                                                           None, 0.5)), linear),
        "loha-conv": (LayerChange(Hadamard(draw(48, 4), draw(4, 360), draw(48, 4), draw(4, 360), None, None, 1.0)),
                      conv),
        "lokr-conv": (LayerChange(Kronecker(draw(4, 4), None, None, None, draw(12, 3), draw(3, 90), None, 1.0)), conv),
        "lokr-conv-tucker": (LayerChange(Kronecker(draw(4, 4), None, None, None, draw(3, 12), draw(3, 10),
                                                   draw(3, 3, 3, 3), 1.0)), conv),
        # A whole w1 stored with the conv's window axes: merged by the float32 block path instead.
        "lokr-conv-w1-with-window": (LayerChange(Kronecker(draw(4, 4, 1, 1), None, None, draw(12, 10, 3, 3), None,
                                                           None, None, 1.0)), conv),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "kind",
    ["loha", "lokr", "lokr-whole-w1-decomposed", "loha-conv", "lokr-conv", "lokr-conv-tucker", "lokr-conv-w1-with-window"],
)
def test_one_loha_or_lokr_alone_is_written_in_the_weights_dtype_to_within_a_rounding_of_its_float32_merge(
    kind: str, dtype: torch.dtype
) -> None:
    """A layer one LoHa or LoKr alone changes is written straight into the weight in its own dtype
    (own_dtype_merges.py): within one rounding of the weight, plus the products' own rounding to the factors'
    dtype, of the float32 reference (add_to, the LyCORIS arithmetic); the same bits on every merge; W0 after."""
    from loraswap.server.engine.adapters.residency import FusedWeights

    generator = torch.Generator().manual_seed(2)
    change, shape = _own_dtype_changes(dtype, generator)[kind]
    torch.manual_seed(3)  # the layer's own initial weights
    layer = (torch.nn.Linear(shape[1], shape[0]) if len(shape) == 2 else torch.nn.Conv2d(shape[1], shape[0], 3)).to(dtype)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    adapter = CanonicalAdapter(name=kind, source="test", warnings=(), load_ms=0.0, layers={}, fits_slot=False,
                               changes={("denoiser", "layer"): change})  # fmt: skip
    fused = FusedWeights.over_layers("denoiser", {"layer": layer})
    fused.merge(((adapter, 0.8),))
    first = layer.weight.detach().clone()
    with torch.no_grad():
        reference = w0.float().clone()  # float() is w0 itself for a float32 layer
        delta = change.dense_delta(torch.device("cpu"), shape) * 0.8
        change.add_to(reference, w0.float(), 0.8)
    eps = torch.finfo(dtype).eps
    # One rounding of the weight (eps |W|), the two products' (LoHa) or one side's (LoKr) roundings (2 eps |ΔW|).
    assert bool(((first.float() - reference).abs() <= eps * reference.abs() + 2 * eps * delta.abs() + 1e-30).all())
    assert (first != w0).float().mean() > 0.5  # the change reached the weight
    if change.bias is not None:
        assert torch.equal(layer.bias, (b0.float() + change.bias.float() * 0.8).to(dtype))
    fused.merge(())
    assert torch.equal(layer.weight, w0) and torch.equal(layer.bias, b0)
    fused.merge(((adapter, 0.8),))
    assert torch.equal(layer.weight, first)


@pytest.mark.parametrize("kind", ["loha", "loha-one-product", "lokr"])
def test_a_loha_or_lokr_written_in_its_own_dtype_that_overflows_is_refused(kind: str) -> None:
    """Factors whose bound passes bfloat16's range are checked, and an overflowing merge is refused as before;
    for LoHa each product's bound counts, not only theirs (2^64 * 2^64 overflows while 2^-60 * 2^-60 makes their
    product's bound small)."""
    from loraswap.server.engine.adapters.formats import Hadamard, Kronecker, LayerChange
    from loraswap.server.engine.adapters.residency import FusedWeights

    huge = torch.full((64, 4), 1e19, dtype=torch.bfloat16)
    big, tiny = torch.full((64, 1), 2.0**64, dtype=torch.bfloat16), torch.full((64, 1), 2.0**-60, dtype=torch.bfloat16)
    change = (LayerChange(Hadamard(huge, huge.T.contiguous(), huge, huge.T.contiguous(), None, None, 1.0))
              if kind == "loha" else
              LayerChange(Hadamard(big, big.T.contiguous(), tiny, tiny.T.contiguous(), None, None, 1.0))
              if kind == "loha-one-product" else LayerChange(Kronecker(torch.full((8, 8), 1e30, dtype=torch.bfloat16), None, None,
                                                           torch.full((8, 8), 1e30, dtype=torch.bfloat16), None, None,
                                                           None, 1.0)))  # fmt: skip
    layer = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    w0 = layer.weight.detach().clone()
    adapter = CanonicalAdapter(name=kind, source="test", warnings=(), load_ms=0.0, layers={}, fits_slot=False,
                               changes={("denoiser", "layer"): change})  # fmt: skip
    fused = FusedWeights.over_layers("denoiser", {"layer": layer})
    with pytest.raises(InvalidRequestError) as refused:
        fused.merge(((adapter, 1.0),))
    assert refused.value.reason == "ADAPTER_OUT_OF_RANGE"
    assert torch.equal(layer.weight, w0)
