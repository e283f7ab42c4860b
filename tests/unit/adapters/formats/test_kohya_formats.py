"""Kohya (sd-scripts) LoRA files for Flux and SDXL, written by the test, read by load_canonical.

Each file is checked two ways: against diffusers' own `load_lora_weights` of
the same file on a fresh tiny pipeline where diffusers reads it, and against
kohya's own arithmetic (`up @ down * alpha / rank`, with fused qkv split by
output rows), so a mapping that diffusers and loraswap got wrong together
would still show.

Both families' kohya files are read by loraswap itself (adapters/formats/key_layouts.py,
original_names.py), every layer at its own alpha. Where diffusers differs, only
kohya's arithmetic is the reference:
- Flux `single_blocks_N_linear1` (the fused qkv+mlp projection): diffusers splits
  it with FLUX.1's hard-coded widths (3072, 3072, 3072, 12288), which a 32-wide
  tiny transformer cannot match; loraswap splits it at the model's own widths.
- Flux `final_layer_linear`: diffusers' converter writes it without the
  `transformer.` prefix and drops it; loraswap applies it to proj_out.
- SDXL attention layers whose alpha differs from the file's most common alpha:
  diffusers gives them the common one.
Text-encoder layers are checked against kohya's arithmetic too (applied by default).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.formats import SlotSpec, load_canonical
from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, EngineError
from tests.support.kohya_files import (
    FLUX_FINAL,
    FLUX_LINEAR1,
    FLUX_SINGLE,
    SDXL_LAYERS,
    TEXT_ENCODER_MODULES,
    flux_double,
    kohya_deltas,
    kohya_file,
    kohya_module,
    sdxl_modules,
)
from tests.support.lora_reference import (
    assert_same_deltas,
    canonical_deltas,
    change_deltas,
    diffusers_deltas,
    kohya_text_encoder_mapping,
    tiny_slot_specs,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def specs() -> dict[str, SlotSpec]:
    return tiny_slot_specs()


def _load(path: Path, spec: SlotSpec):
    return load_canonical(AdapterFile(name=path.stem, path=path, source=str(path)), spec)


FLUX_CASES = {
    "double_blocks": {**flux_double(0), **flux_double(1)},
    "single_linear2": FLUX_SINGLE,
    "mixed": {**flux_double(1), **FLUX_SINGLE},
}


@pytest.mark.parametrize("case", sorted(FLUX_CASES))
@pytest.mark.parametrize("rank", [4, 12])
def test_flux_kohya_matches_diffusers_and_kohya(specs: dict[str, SlotSpec], tmp_path: Path, case: str, rank: int):
    layout = FLUX_CASES[case]
    path = tmp_path / "kohya_flux.safetensors"
    tensors = kohya_file(path, {m: (i, o) for m, (i, o, _) in layout.items()}, rank=rank)

    adapter = _load(path, specs["tiny-flux"])
    canonical = canonical_deltas(adapter)
    assert_same_deltas(canonical, diffusers_deltas("tiny-flux", path)[0])
    assert_same_deltas(canonical, kohya_deltas(tensors, {m: targets for m, (_, _, targets) in layout.items()}))
    assert adapter.rank == rank
    assert adapter.warnings == ()


def test_flux_kohya_block_sparse_qkv_keeps_the_files_rank(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    """A qkv LoRA whose up is block-diagonal: diffusers makes it three rank/3 LoRAs, loraswap three LoRAs of the
    file's rank (one down, the up cut by rows); the deltas are the same."""
    layout = flux_double(0)
    path = tmp_path / "kohya_sparse.safetensors"
    tensors = kohya_file(path, {m: (i, o) for m, (i, o, _) in layout.items()}, rank=6, sparse_qkv=True)

    adapter = _load(path, specs["tiny-flux"])
    canonical = canonical_deltas(adapter)
    assert_same_deltas(canonical, diffusers_deltas("tiny-flux", path)[0])
    assert_same_deltas(canonical, kohya_deltas(tensors, {m: targets for m, (_, _, targets) in layout.items()}))
    ranks = {name: layer.rank for name, layer in adapter.layers.items()}
    assert ranks["transformer_blocks.0.attn.to_q"] == ranks["transformer_blocks.0.attn.add_v_proj"] == 6
    assert ranks["transformer_blocks.0.attn.to_out.0"] == ranks["transformer_blocks.0.ff.net.2"] == 6


@pytest.mark.parametrize("case", ["final_layer", "linear1"])
def test_flux_kohya_layers_diffusers_drops_or_cannot_split(specs: dict[str, SlotSpec], tmp_path: Path, case) -> None:
    """final_layer_linear reaches proj_out; linear1 is cut at the model's widths (kohya's arithmetic only)."""
    layout = {**flux_double(0), **(FLUX_FINAL if case == "final_layer" else FLUX_LINEAR1)}
    path = tmp_path / "kohya_final.safetensors"
    tensors = kohya_file(path, {m: (i, o) for m, (i, o, _) in layout.items()}, alphas={})
    adapter = _load(path, specs["tiny-flux"])
    assert_same_deltas(
        canonical_deltas(adapter), kohya_deltas(tensors, {m: targets for m, (_, _, targets) in layout.items()})
    )


def test_flux_kohya_text_encoder_applied_or_dropped_or_refused(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    layout = flux_double(0)
    modules = {m: (i, o) for m, (i, o, _) in layout.items()}
    text_encoder_module = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    modules[text_encoder_module] = (32, 32)
    path = tmp_path / "kohya_flux_te.safetensors"
    tensors = kohya_file(path, modules)

    adapter = _load(path, specs["tiny-flux"])
    assert_same_deltas(
        canonical_deltas(adapter), kohya_deltas(tensors, {m: targets for m, (_, _, targets) in layout.items()})
    )
    mapping = kohya_text_encoder_mapping(specs["tiny-flux"], [text_encoder_module])
    assert_same_deltas(
        change_deltas(adapter, specs["tiny-flux"], "text_encoder"), kohya_deltas(tensors, mapping["text_encoder"])
    )
    assert adapter.warnings == ()
    ignoring = dataclasses.replace(specs["tiny-flux"], text_encoder_layers="ignore")
    (warning,) = _load(path, ignoring).warnings
    assert "text_encoder (1 layers)" in warning
    with pytest.raises(AdapterIncompatibleError) as raised:
        _load(path, dataclasses.replace(ignoring, strict=True))
    assert raised.value.reason == "ADAPTER_TEXT_ENCODER_LAYERS"


@pytest.mark.parametrize(
    ("modules", "error", "reason"),
    [
        pytest.param(
            {"lora_unet_double_blocks_0_img_mod_lin": (32, 192)},
            AdapterIncompatibleError, "ADAPTER_LAYER_NOT_TARGETED", id="modulation_layer_outside_slot",
        ),
        pytest.param(
            {"lora_unet_double_blocks_0_img_attn_qkv": (32, 96), "lora_unet_double_blocks_0_img_bogus": (32, 32)},
            AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="unknown_kohya_key",
        ),
        pytest.param(
            {"lora_unet_single_blocks_0_linear1": (32, 3 * 32 + 64)},
            AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="linear1_of_another_width",
        ),
    ],
)  # fmt: skip
def test_flux_kohya_refusals(
    specs: dict[str, SlotSpec], tmp_path: Path, modules: dict, error: type[EngineError], reason: str
) -> None:
    path = tmp_path / "kohya_bad.safetensors"
    kohya_file(path, modules)
    with pytest.raises(EngineError) as raised:
        _load(path, specs["tiny-flux"])
    assert type(raised.value) is error
    assert raised.value.reason == reason


@pytest.mark.parametrize(
    "modules",
    [
        pytest.param({"lora_unet_double_blocks_0_img_attn_qkv": (32, 96),
                      "lora_unet_transformer_blocks_0_attn_to_k": (32, 32)}, id="fused_qkv_beside_a_part"),
        pytest.param({"lora_unet_transformer_blocks_0_attn_to_q": (32, 32),
                      "lycoris_transformer_blocks_0_attn_to_q": (32, 32)}, id="two_prefixes"),
    ],
)  # fmt: skip
def test_flux_kohya_layer_changed_twice_is_refused(specs: dict[str, SlotSpec], tmp_path: Path, modules) -> None:
    """Read, one change would replace the other unseen."""
    path = tmp_path / "kohya_twice.safetensors"
    kohya_file(path, modules)
    with pytest.raises(AdapterFormatError) as raised:
        _load(path, specs["tiny-flux"])
    assert raised.value.reason == "ADAPTER_MALFORMED" and "twice" in raised.value.message


# -- SDXL ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["diffusers_names", "sgm_names"])
def test_diffusers_reads_the_sdxl_files_as_kohya_means_them(tmp_path: Path, layout: str) -> None:
    """The oracle itself: diffusers turns both spellings into the layers and values kohya means."""
    modules, alphas, mapping = sdxl_modules(layout)
    path = tmp_path / "kohya_sdxl.safetensors"
    tensors = kohya_file(path, modules, alphas=alphas)
    assert_same_deltas(diffusers_deltas("tiny-sdxl", path)[0], kohya_deltas(tensors, mapping))


@pytest.mark.parametrize("layout", ["diffusers_names", "sgm_names"])
@pytest.mark.parametrize("with_text_encoders", [False, True])
def test_sdxl_kohya_matches_kohya(
    specs: dict[str, SlotSpec], tmp_path: Path, layout: str, with_text_encoders: bool
) -> None:
    modules, alphas, mapping = sdxl_modules(layout)
    if with_text_encoders:
        modules |= TEXT_ENCODER_MODULES
    path = tmp_path / "kohya_sdxl.safetensors"
    tensors = kohya_file(path, modules, alphas=alphas)

    adapter = _load(path, specs["tiny-sdxl"])
    canonical = canonical_deltas(adapter)
    assert_same_deltas(canonical, kohya_deltas(tensors, mapping))
    if layout == "diffusers_names" and not with_text_encoders:
        # The sgm spelling is the same layers (the oracle test above); with kohya text-encoder keys
        # diffusers' own text-encoder loader raises, so only kohya's arithmetic is the reference there.
        assert_same_deltas(canonical, diffusers_deltas("tiny-sdxl", path)[0])
    if with_text_encoders:
        for component, expected in kohya_text_encoder_mapping(specs["tiny-sdxl"], TEXT_ENCODER_MODULES).items():
            assert_same_deltas(change_deltas(adapter, specs["tiny-sdxl"], component), kohya_deltas(tensors, expected))
    assert adapter.warnings == ()


def test_sdxl_kohya_minority_attention_alpha(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    modules, alphas, mapping = sdxl_modules("diffusers_names")
    to_q = kohya_module(SDXL_LAYERS[0][0], "diffusers_names")
    path = tmp_path / "kohya_sdxl_alpha.safetensors"
    tensors = kohya_file(path, modules, alphas=alphas | {to_q: 16.0})
    assert_same_deltas(canonical_deltas(_load(path, specs["tiny-sdxl"])), kohya_deltas(tensors, mapping))


def test_sdxl_kohya_layer_in_sgm_and_diffusers_names_is_refused(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    module, in_features, out_features, _ = SDXL_LAYERS[0]
    path = tmp_path / "kohya_sdxl_twice.safetensors"
    kohya_file(path, {kohya_module(module, layout): (in_features, out_features)
                      for layout in ("diffusers_names", "sgm_names")})  # fmt: skip
    with pytest.raises(AdapterFormatError) as raised:
        _load(path, specs["tiny-sdxl"])
    assert raised.value.reason == "ADAPTER_MALFORMED" and "twice" in raised.value.message


def test_flux_comfyui_prefixed_file_matches_diffusers(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    """ComfyUI saves kohya-named Flux LoRAs under a `diffusion_model.` prefix; diffusers reads it, so do we."""
    layout = {**flux_double(0), **FLUX_SINGLE}
    kohya_path = tmp_path / "kohya.safetensors"
    tensors = kohya_file(kohya_path, {m: (i, o) for m, (i, o, _) in layout.items()})
    comfy = {key.replace("lora_unet_", "diffusion_model.", 1): value for key, value in tensors.items()}
    path = tmp_path / "comfyui.safetensors"
    save_file(comfy, path)
    adapter = _load(path, specs["tiny-flux"])
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas("tiny-flux", path)[0])
    assert_same_deltas(
        canonical_deltas(adapter), kohya_deltas(tensors, {m: targets for m, (_, _, targets) in layout.items()})
    )


def test_flux_xlabs_file_matches_diffusers_and_xlabs(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    """XLabs' Flux LoRAs (`double_blocks.N.processor.qkv_lora1.down.weight`, LoRA only, no alpha) are diffusers' to
    read: each qkv up is cut by rows over q, k, v with the one down, ΔW = up @ down."""
    generator = torch.Generator().manual_seed(4)
    block = "transformer_blocks.0.attn"
    layers = {"qkv_lora1": (96, [f"{block}.to_q", f"{block}.to_k", f"{block}.to_v"]),
              "qkv_lora2": (96, [f"{block}.add_q_proj", f"{block}.add_k_proj", f"{block}.add_v_proj"]),
              "proj_lora1": (32, [f"{block}.to_out.0"]), "proj_lora2": (32, [f"{block}.to_add_out"])}  # fmt: skip
    tensors, expected = {}, {}
    for name, (rows, targets) in layers.items():
        down, up = torch.randn(4, 32, generator=generator) * 0.2, torch.randn(rows, 4, generator=generator) * 0.2
        tensors[f"double_blocks.0.processor.{name}.down.weight"] = down
        tensors[f"double_blocks.0.processor.{name}.up.weight"] = up
        for index, target in enumerate(targets):
            expected[target] = up[index * 32 : (index + 1) * 32] @ down
    path = tmp_path / "xlabs.safetensors"
    save_file(tensors, path)
    adapter = _load(path, specs["tiny-flux"])
    assert_same_deltas(canonical_deltas(adapter), expected)
    assert_same_deltas(canonical_deltas(adapter), diffusers_deltas("tiny-flux", path)[0])
