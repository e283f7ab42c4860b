"""LyCORIS files (LoHa, LoKr, LoCon, full, DoRA; Tucker cores; text-encoder layers) on a real tiny-sdxl runtime.

The files are written by the LyCORIS package's own kohya network (tests/support/lycoris_files.py). After a fused
merge, every layer the file changes must compute what that network's own forward computes on a fresh pipeline,
for every kind and strength, in stacks of mixed kinds (the sum of the members' changes) and for the text encoders;
restoring leaves every weight bit for bit as it was; what the server does not implement is refused by kind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraswap.server.engine.adapters.formats import load_canonical
from loraswap.server.engine.adapters.sources import LocalAdapterDirectory
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, AdapterTooLargeError
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.startup import start_runtime
from tests.support.lycoris_files import (
    KINDS,
    TEST_PRESET,
    UNSUPPORTED_KINDS,
    applied_network,
    network_modules,
    probe,
    write_lycoris_file,
)

MAX_RANK = 16
# A plain LyCORIS LoRA of the attention layers only (slot layers) with text-encoder layers: it fits the slot.
SLOT_LORA = dict(algo="lora")
ATTENTION_PRESET = dict(TEST_PRESET, unet_target_module=["Transformer2DModel"], unet_target_name=[])


@pytest.fixture(scope="module")
def lycoris_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lycoris")
    for seed, (name, kind) in enumerate({**KINDS, **UNSUPPORTED_KINDS}.items(), start=1):
        write_lycoris_file(directory / f"{name}.safetensors", kind, seed=seed)
    return directory


@pytest.fixture(scope="module")
def runtime():
    return start_runtime(
        EngineConfig(model="tiny-sdxl", max_rank=MAX_RANK, compile=False, warmup=False, torch_threads=1, fuse="always")
    )


@pytest.fixture(scope="module")
def pristine(runtime):
    """Every mergeable weight and bias of the runtime as it was before any merge."""
    return {
        key: [tensor.detach().clone() for tensor in (module.weight, module.bias) if tensor is not None]
        for key, module in runtime.installed.model_layers.modules.items()
    }


def _load(runtime, lycoris_dir, name: str, spec=None):
    return load_canonical(LocalAdapterDirectory(lycoris_dir).find(name), spec or runtime.slot_spec())


def _live(runtime, key: tuple[str, str]) -> torch.nn.Module:
    return runtime.installed.model_layers.module(*key)


def _reference_outputs(lycoris_dir, name: str, scale: float, preset: dict = TEST_PRESET):
    """(component, module) -> (probe input, the LyCORIS network's output) for every module of the file."""
    pipe = builtin_model("tiny-sdxl").build()
    network = applied_network(lycoris_dir / f"{name}.safetensors", pipe, scale, preset)
    generator = torch.Generator().manual_seed(0)
    outputs = {}
    with torch.no_grad():
        for key, module in sorted(network_modules(network, pipe).items()):
            x = probe(module, generator)
            outputs[key] = (x, module(x))
    return outputs


def _assert_layers_compute(runtime, expected: dict) -> None:
    with torch.no_grad():
        for key, (x, wanted) in expected.items():
            got = _live(runtime, key)(x)
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-5 * float(wanted.abs().max()), msg=str(key))


def _assert_pristine(runtime, pristine) -> None:
    for key, tensors in pristine.items():
        module = _live(runtime, key)
        now = [tensor for tensor in (module.weight, module.bias) if tensor is not None]
        assert all(torch.equal(a, b) for a, b in zip(now, tensors)), key


@pytest.mark.parametrize(("name", "scale"), [(name, 1.0) for name in KINDS] + [("loha", 0.6), ("lokr", -0.8),
                                             ("dora", 0.5), ("locon-tucker", 1.7), ("loha-dora", -0.4)])  # fmt: skip
def test_every_kind_merges_to_what_the_lycoris_network_computes(runtime, pristine, lycoris_dir, name, scale) -> None:
    adapter = _load(runtime, lycoris_dir, name)
    expected = _reference_outputs(lycoris_dir, name, scale)
    # Nothing dropped: every layer of the file is a layer the adapter changes.
    assert set(adapter.changes) | {("unet", module) for module in adapter.layers} == set(expected)
    assert adapter.warnings == () and not adapter.fits_slot
    assert set(adapter.layers_per_component("unet")) == {"unet", "text_encoder", "text_encoder_2"}
    runtime.residency.load_stack(((adapter, scale),), fused=True)
    try:
        _assert_layers_compute(runtime, expected)
    finally:
        runtime.residency.load_stack((), fused=False)
    _assert_pristine(runtime, pristine)


def test_the_kinds_are_reported(runtime, lycoris_dir) -> None:
    kinds = {name: _load(runtime, lycoris_dir, name).kinds for name in ("loha", "lokr", "full", "dora", "locon")}
    assert kinds == {"loha": ("loha",), "lokr": ("lokr",), "full": ("full",), "dora": ("lora+dora",),
                     "locon": ("lora",)}  # fmt: skip


def test_a_stack_of_mixed_kinds_is_the_sum_of_its_members_changes(runtime, pristine, lycoris_dir) -> None:
    members = {"loha": 0.7, "locon": -0.5, "lokr": 1.2}
    base_pipe = builtin_model("tiny-sdxl").build()
    outputs = {name: _reference_outputs(lycoris_dir, name, scale) for name, scale in members.items()}
    expected = {}
    with torch.no_grad():
        for key in set().union(*outputs.values()):
            x = next(out[key][0] for out in outputs.values() if key in out)  # the same seed gives the same probes
            y0 = getattr(base_pipe, key[0]).get_submodule(key[1])(x)
            expected[key] = (x, y0 + sum(out[key][1] - y0 for out in outputs.values()))
    stack = tuple((_load(runtime, lycoris_dir, name), scale) for name, scale in members.items())
    runtime.residency.load_stack(stack, fused=True)
    try:
        _assert_layers_compute(runtime, expected)
    finally:
        runtime.residency.load_stack((), fused=False)
    _assert_pristine(runtime, pristine)


def test_a_slot_lora_with_text_encoder_layers_runs_unfused_with_its_text_encoders_merged(
    runtime, pristine, tmp_path
) -> None:
    write_lycoris_file(tmp_path / "slot-lora.safetensors", SLOT_LORA, seed=11, preset=ATTENTION_PRESET)
    adapter = _load(runtime, tmp_path, "slot-lora")
    assert adapter.fits_slot and adapter.layers
    assert set(adapter.changes) == set(adapter.changes_in({"text_encoder", "text_encoder_2"})) != set()
    expected = _reference_outputs(tmp_path, "slot-lora", 0.9, ATTENTION_PRESET)
    runtime.residency.load_stack(((adapter, 0.9),), fused=False)
    try:
        assert not runtime.residency.fused
        with torch.no_grad():
            for (component, module), (x, wanted) in expected.items():
                layer = getattr(runtime.loaded.pipe, component).get_submodule(module)  # the slot's, for the unet
                torch.testing.assert_close(layer(x), wanted, rtol=1e-4, atol=1e-5 * float(wanted.abs().max()))
    finally:
        runtime.residency.load_stack((), fused=False)
    _assert_pristine(runtime, pristine)


@pytest.mark.parametrize(("name", "kind"), [("diag-oft", "OFT"), ("ia3", "IA³")])
def test_kinds_the_server_does_not_merge_are_refused_by_kind(runtime, lycoris_dir, name, kind) -> None:
    with pytest.raises(AdapterFormatError) as raised:
        _load(runtime, lycoris_dir, name)
    assert raised.value.reason == "ADAPTER_KIND_UNSUPPORTED"
    assert kind in raised.value.metadata["kind"] and "lora_" in raised.value.message


def test_without_fusing_only_a_fused_kind_is_refused_saying_how_to_serve_it(runtime, lycoris_dir) -> None:
    never = dataclasses.replace(runtime.slot_spec(), fuse=False)
    with pytest.raises(AdapterIncompatibleError) as raised:
        _load(runtime, lycoris_dir, "loha", never)
    assert raised.value.reason == "ADAPTER_INCOMPATIBLE" and "--fuse auto|always" in raised.value.message
    assert raised.value.metadata["kinds"] == "loha"
    with pytest.raises(AdapterIncompatibleError) as raised:
        _load(runtime, lycoris_dir, "locon", never)  # plain LoRA factors, but on convs outside the slot
    assert raised.value.reason == "ADAPTER_LAYER_NOT_TARGETED"


def _edited(lycoris_dir, tmp_path, name: str, edit) -> str:
    tensors = load_file(lycoris_dir / f"{name}.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / f"{name}-edited.safetensors")
    return f"{name}-edited"


def _first(tensors, suffix: str) -> str:
    return next(key for key in sorted(tensors) if key.startswith("lora_unet_") and key.endswith(suffix))


@pytest.mark.parametrize(
    ("name", "edit", "reason"),
    [
        ("loha", lambda t: t.pop(_first(t, ".hada_w2_b")), "ADAPTER_MALFORMED"),
        ("lokr", lambda t: t.__setitem__(_first(t, ".lokr_w1"), torch.ones(3, 5)), "ADAPTER_SHAPE_MISMATCH"),
        ("full", lambda t: t.__setitem__(_first(t, ".diff_b"), torch.ones(7)), "ADAPTER_SHAPE_MISMATCH"),
        ("dora", lambda t: t.__setitem__(_first(t, ".dora_scale"), torch.ones(2, 9)), "ADAPTER_SHAPE_MISMATCH"),
        ("loha", lambda t: t[_first(t, ".hada_w1_a")].__setitem__((0, 0), float("nan")), "ADAPTER_NOT_FINITE"),
        ("locon", lambda t: t.__setitem__(_first(t, ".alpha"), torch.ones(2)), "ADAPTER_SHAPE_MISMATCH"),
        ("loha", lambda t: t.__setitem__("lora_unet_down_blocks_9_resnets_0_conv1.hada_w1_a", torch.ones(2, 2)),
         "ADAPTER_SHAPE_MISMATCH"),
        ("loha", lambda t: t.__setitem__(_first(t, ".hada_w1_a").replace("hada_w1_a", "oft_blocks"),
                                         torch.ones(2, 2)), "ADAPTER_KIND_UNSUPPORTED"),
        ("loha", lambda t: t.__setitem__(_first(t, ".hada_w1_a").replace("hada_w1_a", "mystery"), torch.ones(2)),
         "ADAPTER_UNSUPPORTED_TENSORS"),
    ],
    ids=["loha-missing-factor", "lokr-wrong-shape", "diff_b-wrong-length", "dora-scale-wrong-shape",
         "loha-nan", "alpha-not-a-number", "layer-the-model-lacks", "oft-tensor-in-a-loha", "unknown-tensor"],
)  # fmt: skip
def test_broken_lycoris_files_are_refused_with_their_reason(runtime, lycoris_dir, tmp_path, name, edit, reason):
    edited = _edited(lycoris_dir, tmp_path, name, edit)
    with pytest.raises((AdapterFormatError, AdapterIncompatibleError)) as raised:
        _load(runtime, tmp_path, edited)
    assert raised.value.reason == reason, raised.value.message


def test_a_merge_past_the_pristine_budget_is_refused_and_changes_nothing(runtime, lycoris_dir, tmp_path) -> None:
    slot_copies = runtime.installed.pristine_bytes
    tight = start_runtime(
        EngineConfig(model="tiny-sdxl", max_rank=MAX_RANK, compile=False, warmup=False, torch_threads=1,
                     fuse="always", fuse_memory_bytes=slot_copies + 1024)
    )  # fmt: skip
    before = {key: module.weight.detach().clone() for key, module in tight.installed.model_layers.modules.items()}
    adapter = load_canonical(LocalAdapterDirectory(lycoris_dir).find("loha"), tight.slot_spec())
    with pytest.raises(AdapterTooLargeError) as raised:
        tight.residency.load_stack(((adapter, 1.0),), fused=True)
    assert raised.value.reason == "FUSE_MEMORY_EXCEEDED" and "--fuse-memory-bytes" in raised.value.message
    assert all(torch.equal(module.weight, before[key]) for key, module in tight.installed.model_layers.modules.items())
    assert not tight.residency.resident_adapters


def _first_layer(tensors, suffix: str) -> str:
    """The kohya layer name (without the tensor) of the first unet layer holding `suffix`."""
    return _first(tensors, suffix).rsplit(".", 1)[0]


def _add_lora_beside_loha(tensors) -> None:
    layer = _first_layer(tensors, ".hada_w1_a")
    out_features, in_features = tensors[f"{layer}.hada_w1_a"].shape[0], tensors[f"{layer}.hada_w1_b"].shape[1]
    tensors[f"{layer}.lora_up.weight"] = torch.full((out_features, 2), 0.1)
    tensors[f"{layer}.lora_down.weight"] = torch.full((2, in_features), 0.1)


def _add_lokr_beside_loha(tensors) -> None:
    layer = _first_layer(tensors, ".hada_w1_a")
    tensors[f"{layer}.lokr_w1"] = torch.ones(1, 1)
    tensors[f"{layer}.lokr_w2"] = torch.full((tensors[f"{layer}.hada_w1_a"].shape[0], 1), 0.1)


@pytest.mark.parametrize(
    ("edit", "kinds"),
    [(_add_lora_beside_loha, "LoHa,LoRA"), (_add_lokr_beside_loha, "LoHa,LoKr")],
    ids=["loha-and-lora-keys", "loha-and-lokr-keys"],
)
def test_a_layer_with_the_tensors_of_two_kinds_is_refused_naming_them(runtime, lycoris_dir, tmp_path, edit, kinds):
    """Served as one kind, the other's tensors would be dropped with no word: the layer is refused instead."""
    edited = _edited(lycoris_dir, tmp_path, "loha", edit)
    with pytest.raises(AdapterFormatError) as raised:
        _load(runtime, tmp_path, edited)
    error = raised.value
    assert error.reason == "ADAPTER_MIXED_KINDS" and error.metadata["kinds"] == kinds, error.message
    assert error.metadata["layer"] in error.message and "one kind per layer" in error.message


def test_a_lokr_side_stored_both_whole_and_as_a_product_is_refused(runtime, lycoris_dir, tmp_path) -> None:
    def both(tensors) -> None:
        layer = _first_layer(tensors, ".lokr_w2_a") if any(k.endswith(".lokr_w2_a") for k in tensors) else None
        layer = layer or _first_layer(tensors, ".lokr_w2")
        w2 = tensors.get(f"{layer}.lokr_w2")
        if w2 is None:
            tensors[f"{layer}.lokr_w2"] = tensors[f"{layer}.lokr_w2_a"] @ tensors[f"{layer}.lokr_w2_b"]
        else:
            tensors[f"{layer}.lokr_w2_a"], tensors[f"{layer}.lokr_w2_b"] = torch.ones(w2.shape[0], 1), w2[:1]

    edited = _edited(lycoris_dir, tmp_path, "lokr", both)
    with pytest.raises(AdapterFormatError) as raised:
        _load(runtime, tmp_path, edited)
    assert raised.value.reason == "ADAPTER_MALFORMED" and "both whole (lokr_w2)" in raised.value.message


def test_a_tucker_core_of_the_wrong_shape_is_refused_in_our_words(runtime, lycoris_dir, tmp_path) -> None:
    def bad_core(tensors) -> None:
        key = _first(tensors, ".hada_t1")
        tensors[key] = torch.ones(*tensors[key].shape[:-1], tensors[key].shape[-1] + 2)

    edited = _edited(lycoris_dir, tmp_path, "loha-tucker", bad_core)
    with pytest.raises(AdapterFormatError) as raised:
        _load(runtime, tmp_path, edited)
    message = raised.value.message
    assert raised.value.reason == "ADAPTER_SHAPE_MISMATCH" and "hada_t1 (" in message, message
    # Our words: the factors' shapes, not the text of the torch operation that gave up on them.
    assert not any(word in message for word in ("broadcast", "Attempting", "dimension of length", "einsum")), message


def test_oft_and_boft_files_get_labels_of_their_own(runtime, lycoris_dir, tmp_path) -> None:
    """diag-OFT's blocks are (blocks, size, size), BOFT's carry a leading axis of butterfly stages."""
    with pytest.raises(AdapterFormatError) as oft:
        _load(runtime, lycoris_dir, "diag-oft")

    def boft(tensors) -> None:
        for key in [key for key in tensors if key.endswith(".oft_blocks")]:
            tensors[key] = tensors[key].unsqueeze(0).repeat(2, 1, 1, 1)

    with pytest.raises(AdapterFormatError) as butterfly:
        _load(runtime, tmp_path, _edited(lycoris_dir, tmp_path, "diag-oft", boft))
    labels = oft.value.metadata["kind"], butterfly.value.metadata["kind"]
    assert labels[0].startswith("OFT") and labels[1].startswith("BOFT"), labels
    assert all(error.value.reason == "ADAPTER_KIND_UNSUPPORTED" for error in (oft, butterfly))
    assert "BOFT" not in oft.value.message and labels[1] in butterfly.value.message
