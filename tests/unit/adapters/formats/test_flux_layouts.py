"""LyCORIS kinds in the Flux layouts model sites carry, on a real tiny-flux runtime, against LyCORIS's own modules.

The files (tests/support/flux_files.py) hold lycoris-lora's own modules: on BFL layers (sd-scripts' and LyCORIS's
names for the original Flux model: qkv and linear1 stack several diffusers layers by rows, the final modulation is
norm_out with its halves swapped) and on diffusers layers (ai-toolkit's `lora_transformer_`, LyCORIS's `lycoris_`).
After a fused merge, each diffusers layer must compute its rows of what its module computes, for every kind and
strength; restoring leaves every weight as it was. Full-size FLUX.1's names are checked against diffusers'
single-file converter in test_bfl_names.py.
"""

from __future__ import annotations

import pytest
import torch

from loraswap.server.engine.adapters.formats import load_canonical
from loraswap.server.engine.adapters.sources import LocalAdapterDirectory
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import AdapterFormatError
from loraswap.server.engine.pipeline.startup import start_runtime
from tests.support.flux_files import BFL_LAYERS, STACKED, FluxFile
from tests.support.lycoris_files import MODULE_KINDS, module_tensors

MERGED_KINDS = sorted(set(MODULE_KINDS) - {"dora-columns"})


@pytest.fixture(scope="module")
def runtime():
    return start_runtime(
        EngineConfig(model="tiny-flux", max_rank=16, compile=False, warmup=False, torch_threads=1, fuse="always")
    )


def _load(runtime, path):
    return load_canonical(LocalAdapterDirectory(path.parent).find(path.stem), runtime.slot_spec())


def _assert_merged(runtime, flux_file: FluxFile, adapter, scale: float) -> None:
    expected = flux_file.expected(scale)
    layers = runtime.installed.model_layers
    pristine = {module: layers.module("transformer", module).weight.detach().clone() for module in expected}
    runtime.residency.load_stack(((adapter, scale),), fused=True)
    try:
        with torch.no_grad():
            for module, (x, wanted) in expected.items():
                got = layers.module("transformer", module)(x)
                torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-5 * float(wanted.abs().max()), msg=module)
    finally:
        runtime.residency.load_stack((), fused=False)
    for module, weight in pristine.items():
        assert torch.equal(layers.module("transformer", module).weight, weight), module


@pytest.mark.parametrize("kind", MERGED_KINDS)
def test_bfl_layers_of_every_kind_merge_to_what_lycoris_computes(runtime, tmp_path, kind) -> None:
    flux_file = FluxFile(tmp_path / f"bfl-{kind}.safetensors", "bfl", dict.fromkeys(BFL_LAYERS, kind), seed=3)
    adapter = _load(runtime, tmp_path / f"bfl-{kind}.safetensors")
    # Nothing dropped: every diffusers layer of every BFL layer is changed, and only those.
    changed = set(adapter.layers) | {module for _, module in adapter.changes}
    assert changed == {module for targets in BFL_LAYERS.values() for module, _ in targets}
    assert adapter.warnings == ()
    _assert_merged(runtime, flux_file, adapter, 1.0)


@pytest.mark.parametrize(("kind", "scale"), [("lokr", -0.7), ("loha-dora", 0.6), ("lora", 1.6)])
def test_bfl_strengths(runtime, tmp_path, kind, scale) -> None:
    flux_file = FluxFile(tmp_path / "bfl.safetensors", "bfl", dict.fromkeys(BFL_LAYERS, kind), seed=5)
    _assert_merged(runtime, flux_file, _load(runtime, tmp_path / "bfl.safetensors"), scale)


def test_a_bfl_file_of_mixed_kinds_puts_its_plain_loras_in_the_slot(runtime, tmp_path) -> None:
    """A plain LoRA of a qkv is three LoRAs of slot layers (one down, up cut by rows); the rest are changes."""
    kinds = {name: MERGED_KINDS[index % len(MERGED_KINDS)] for index, name in enumerate(sorted(BFL_LAYERS))}
    kinds["double_blocks_0_img_attn_qkv"] = "lora"
    flux_file = FluxFile(tmp_path / "mixed.safetensors", "bfl", kinds, seed=7)
    adapter = _load(runtime, tmp_path / "mixed.safetensors")
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v"} <= set(adapter.layers)
    assert adapter.layers["transformer_blocks.0.attn.to_k"].rank == 4
    assert set(adapter.kinds) > {"lora", "loha", "lokr"}
    _assert_merged(runtime, flux_file, adapter, 0.9)
    # The three parts of a stacked layer share their file tensors: the adapter holds about the file's bytes.
    file_bytes = sum(t.numel() * 4 for t in module_tensors({n: m for n, (m, _) in flux_file.layers.items()}).values())
    assert adapter.nbytes <= file_bytes


@pytest.mark.parametrize("layout", ["ai-toolkit", "lycoris"])
@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_diffusers_named_layouts_merge_to_what_lycoris_computes(runtime, tmp_path, layout, kind) -> None:
    layers = ["double_blocks_0_img_attn_qkv", "single_blocks_1_linear1", "final_layer_linear", "img_in"]
    path = tmp_path / f"{layout}.safetensors"
    flux_file = FluxFile(path, layout, dict.fromkeys(layers, kind), seed=9)
    _assert_merged(runtime, flux_file, _load(runtime, path), 1.0)


def test_a_dora_normalised_per_column_merges_on_whole_layers(runtime, tmp_path) -> None:
    """LyCORIS's wd_on_output=False (magnitudes per input column), which its own loader cannot read back."""
    whole = sorted(set(BFL_LAYERS) - STACKED)
    flux_file = FluxFile(tmp_path / "columns.safetensors", "bfl", dict.fromkeys(whole, "dora-columns"), seed=11)
    _assert_merged(runtime, flux_file, _load(runtime, tmp_path / "columns.safetensors"), 0.8)


def test_a_dora_normalised_per_column_on_a_stacked_layer_is_refused_by_kind(runtime, tmp_path) -> None:
    path = tmp_path / "stacked-columns.safetensors"
    FluxFile(path, "bfl", {"double_blocks_0_img_attn_qkv": "dora-columns"}, seed=13)
    with pytest.raises(AdapterFormatError) as refused:
        _load(runtime, path)
    assert refused.value.reason.name == "ADAPTER_KIND_UNSUPPORTED"
    assert "lora_unet_double_blocks_0_img_attn_qkv" in str(refused.value)


def test_lycoris_kinds_in_a_layout_only_diffusers_reads_are_refused_naming_the_layouts_read(runtime, tmp_path):
    """A ComfyUI-prefixed (`diffusion_model.`) LoKr: diffusers' converters read plain LoRAs there only, and the
    refusal says in which names this server reads LyCORIS kinds."""
    from safetensors.torch import save_file

    path = tmp_path / "comfy-lokr.safetensors"
    layer = "diffusion_model.double_blocks.0.img_attn.proj"
    save_file({f"{layer}.lokr_w1": torch.randn(4, 4), f"{layer}.lokr_w2": torch.randn(8, 8),
               f"{layer}.alpha": torch.tensor(4.0)}, str(path))  # fmt: skip
    with pytest.raises(AdapterFormatError) as refused:
        _load(runtime, path)
    assert refused.value.reason.name == "ADAPTER_MALFORMED"
    assert "lora_unet_" in str(refused.value) and "diffusion_model." in str(refused.value)
