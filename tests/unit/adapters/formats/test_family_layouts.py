"""The adapter layouts Qwen-Image, Z-Image and FLUX.2 files come in, read into canonical form and merged densely.

Each file is written here (safetensors, random factors, an alpha per layer where the layout has alphas) for a tiny
meta-device transformer of the family (family_models.py: widths no published model has), read by load_canonical,
and every diffusers layer's ΔW (a slot layer's b @ a, a change's dense ΔW) must be the one made by hand from the
file: `up @ down * alpha / rank`, a fused layer's rows cut in the order the table below gives, BFL's final modulation
with its halves swapped. Where diffusers' own converter reads a layout correctly, its output is a second reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.formats import comfy_as_kohya, load_canonical, normalised_keys
from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError
from loraswap.server.engine.types import ModelFamily
from tests.unit.adapters.formats.family_models import model, slot_spec

RANK = 3
ALL = None  # every row of the diffusers layer


def _stacked(block: str, layers: tuple[str, ...], width: int = 24) -> list[tuple[str, list[tuple[int, int]]]]:
    """A fused layer's parts: `block`'s layers, `width` rows each, in this order."""
    return [(f"{block}.{layer}", [(i * width, (i + 1) * width)]) for i, layer in enumerate(layers)]


def _renamed(layers: dict[str, str]) -> dict[str, list[tuple[str, None]]]:
    """File layers that are one diffusers layer each (file name -> diffusers name), every row."""
    return {name: [(layer, ALL)] for name, layer in layers.items()}


def _whole(*layers: str) -> dict[str, list[tuple[str, None]]]:
    """Layers the file names as diffusers does."""
    return _renamed({layer: layer for layer in layers})


# family (family_models.TINY) -> file layer (module path as the file names it) -> [(diffusers layer, the file
# layer's rows it gets, in its own row order)]. Widths: Qwen-Image and FLUX.2 3 heads x 8, Z-Image 24.
QKV, ADDED_QKV = ("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")
FILE_LAYERS: dict[str, dict[str, list[tuple[str, list[tuple[int, int]] | None]]]] = {
    "qwen-image": _whole(
        "transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_v_proj", "transformer_blocks.0.img_mod.1",
        "transformer_blocks.1.txt_mlp.net.0.proj", "transformer_blocks.1.img_mlp.net.2", "img_in", "norm_out.linear",
        "time_text_embed.timestep_embedder.linear_1",
    ),
    "z-image": {
        "layers.0.attention.qkv": _stacked("layers.0.attention", QKV),
        "context_refiner.0.attention.qkv": _stacked("context_refiner.0.attention", QKV),
        **_renamed({"noise_refiner.0.attention.out": "noise_refiner.0.attention.to_out.0",
                    "x_embedder": "all_x_embedder.2-1", "final_layer.linear": "all_final_layer.2-1.linear",
                    "final_layer.adaLN_modulation.1": "all_final_layer.2-1.adaLN_modulation.1"}),
        **_whole("layers.1.attention.to_k", "layers.1.feed_forward.w2", "layers.0.adaLN_modulation.0",
                 "cap_embedder.1"),
    },
    "flux2": {
        "double_blocks.0.img_attn.qkv": _stacked("transformer_blocks.0.attn", QKV),
        "double_blocks.1.txt_attn.qkv": _stacked("transformer_blocks.1.attn", ADDED_QKV),
        "final_layer.adaLN_modulation.1": [("norm_out.linear", [(24, 48), (0, 24)])],  # BFL (shift, scale)
        **_renamed({
            "double_blocks.0.img_attn.proj": "transformer_blocks.0.attn.to_out.0",
            "double_blocks.1.txt_attn.proj": "transformer_blocks.1.attn.to_add_out",
            "double_blocks.0.img_mlp.0": "transformer_blocks.0.ff.linear_in",
            "double_blocks.1.txt_mlp.2": "transformer_blocks.1.ff_context.linear_out",
            "single_blocks.1.linear1": "single_transformer_blocks.1.attn.to_qkv_mlp_proj",
            "single_blocks.0.linear2": "single_transformer_blocks.0.attn.to_out",
            "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
            "single_stream_modulation.lin": "single_stream_modulation.linear",
            "img_in": "x_embedder",
            "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
            "final_layer.linear": "proj_out",
        }),
        **_whole("transformer_blocks.1.attn.to_k"),  # a diffusers-named layer beside BFL ones
    },
}  # fmt: skip
# The layouts every file layer is written in: (key of its down factor, of its up factor, of its alpha or None).
LAYOUTS = {
    "kohya": lambda path: (f"lora_unet_{_flat(path)}.lora_down.weight", f"lora_unet_{_flat(path)}.lora_up.weight",
                           f"lora_unet_{_flat(path)}.alpha"),
    "comfy lora_A": lambda path: (f"diffusion_model.{path}.lora_A.weight", f"diffusion_model.{path}.lora_B.weight",
                                  None),
    "comfy lora_down": lambda path: (f"diffusion_model.{path}.lora_down.weight",
                                     f"diffusion_model.{path}.lora_up.weight", f"diffusion_model.{path}.alpha"),
    "peft-wrapped": lambda path: (f"base_model.model.{path}.lora_A.default.weight",
                                  f"base_model.model.{path}.lora_B.default.weight", None),
}  # fmt: skip
# Layouts of diffusers' module names only.
DIFFUSERS_LAYOUTS = {
    "diffusers": lambda path: (f"transformer.{path}.lora_A.weight", f"transformer.{path}.lora_B.weight", None),
    "diffusers + alpha": lambda path: (f"transformer.{path}.lora_A.weight", f"transformer.{path}.lora_B.weight",
                                       f"transformer.{path}.alpha"),
    "diffusers, kohya factors": lambda path: (f"transformer.{path}.lora_down.weight",
                                              f"transformer.{path}.lora_up.weight", f"transformer.{path}.alpha"),
    "PEFT adapter name": lambda path: (f"transformer.{path}.lora_A.default.weight",
                                       f"transformer.{path}.lora_B.default.weight", None),
    "unprefixed": lambda path: (f"{path}.lora_A.weight", f"{path}.lora_B.weight", None),
}  # fmt: skip


def _flat(path: str) -> str:
    return path.replace(".", "_")


def _rows(family: str, targets) -> list[tuple[str, list[tuple[int, int]]]]:
    """The targets with ALL made explicit from the model's own layer."""
    _, _, layers = model(family, tiny=True)
    return [(module, rows if rows is not ALL else [(0, layers.shape("transformer", module).out_features)])
            for module, rows in targets]  # fmt: skip


def write_file(path: Path, family: str, file_layers: dict, layout, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the file layers in `layout`; returns each diffusers layer's ΔW as the file means it."""
    _, _, layers = model(family, tiny=True)
    generator = torch.Generator().manual_seed(seed)
    tensors, expected = {}, {}
    for index, (file_layer, targets) in enumerate(sorted(file_layers.items())):
        targets = _rows(family, targets)
        in_features = layers.shape("transformer", targets[0][0]).weight[1]
        out_features = sum(stop - start for _, rows in targets for start, stop in rows)
        down = torch.randn(RANK, in_features, generator=generator)
        up = torch.randn(out_features, RANK, generator=generator)
        down_key, up_key, alpha_key = layout(file_layer)
        tensors[down_key], tensors[up_key] = down, up
        scale = 1.0
        if alpha_key is not None:
            alpha = 0.5 + index
            tensors[alpha_key] = torch.tensor(alpha)
            scale = alpha / RANK
        delta = up @ down * scale
        for module, rows in targets:
            expected[module] = torch.cat([delta[start:stop] for start, stop in rows])
    save_file(tensors, str(path))
    return expected


def load(path: Path, family: str, **spec):
    return load_canonical(
        AdapterFile(name=path.stem, path=path, source=path.name), slot_spec(family, tiny=True, **spec)
    )


def dense_deltas(adapter, family: str) -> dict[str, torch.Tensor]:
    """Every layer's ΔW at strength 1: a slot layer's b @ a, a change's dense ΔW."""
    _, _, layers = model(family, tiny=True)
    deltas = {module: layer.b @ layer.a for module, layer in adapter.layers.items()}
    for (component, module), change in adapter.changes.items():
        assert component == "transformer" and module not in deltas
        deltas[module] = change.dense_delta(torch.device("cpu"), layers.shape(component, module).weight)
    return deltas


def assert_deltas(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for module, delta in expected.items():
        torch.testing.assert_close(actual[module], delta, rtol=1e-5, atol=1e-5, msg=module)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", sorted(FILE_LAYERS))
def test_every_layout_of_every_family_merges_to_the_files_delta(tmp_path: Path, family: str, layout: str) -> None:
    path = tmp_path / "adapter.safetensors"
    expected = write_file(path, family, FILE_LAYERS[family], LAYOUTS[layout])
    adapter = load(path, family)
    assert_deltas(dense_deltas(adapter, family), expected)
    assert adapter.warnings == ()
    # Plain LoRAs of slot layers are in the slot, the rest are changes the fused swap merges.
    assert set(adapter.layers) == set(expected) & set(slot_spec(family, tiny=True).layer_shapes)


def _diffusers_named(family: str) -> dict:
    """The file layers named by their one diffusers layer (no fused original layer)."""
    return {path: targets for path, targets in FILE_LAYERS[family].items() if targets == [(path, ALL)]}


@pytest.mark.parametrize("layout", sorted(DIFFUSERS_LAYOUTS))
@pytest.mark.parametrize("family", sorted(FILE_LAYERS))
def test_diffusers_named_layouts_diffusers_converters_miss_are_read(tmp_path: Path, family: str, layout: str) -> None:
    """Already `transformer.`-prefixed keys with alphas or PEFT's adapter name (which Qwen-Image's and Z-Image's
    converters prefix twice), kohya factor names (FLUX.2's kohya converter drops them) and unprefixed keys
    (diffusers' loader drops them unseen)."""
    path = tmp_path / "adapter.safetensors"
    expected = write_file(path, family, _diffusers_named(family), DIFFUSERS_LAYOUTS[layout])
    assert_deltas(dense_deltas(load(path, family), family), expected)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_z_image_layers_keyed_by_patch_size_are_read_in_every_layout(tmp_path: Path, layout: str) -> None:
    """Z-Image's per-patch-size layers (`all_x_embedder.2-1`, `all_final_layer.2-1.…`) have a '-' in their module
    path, which kohya-style names keep (`lora_unet_all_x_embedder_2-1`, as LyCORIS writes them)."""
    file_layers = {"all_x_embedder.2-1": [("all_x_embedder.2-1", ALL)],
                   "all_final_layer.2-1.linear": [("all_final_layer.2-1.linear", ALL)],
                   "layers.0.attention.to_v": [("layers.0.attention.to_v", ALL)]}  # fmt: skip
    path = tmp_path / "adapter.safetensors"
    expected = write_file(path, "z-image", file_layers, LAYOUTS[layout])
    assert_deltas(dense_deltas(load(path, "z-image"), "z-image"), expected)


@pytest.mark.parametrize("prefix", ["", "diffusion_model."])
def test_a_layout_only_diffusers_knows_reaches_its_converter_whole(tmp_path: Path, prefix: str) -> None:
    """Z-Image's dot-separated factor names (`….qkv.lora.down.weight`), which only its converter reads: neither the
    renames nor the normalisations touch such a file."""

    def dotted(layer: str) -> tuple[str, str, str]:
        return f"{prefix}{layer}.lora.down.weight", f"{prefix}{layer}.lora.up.weight", f"{prefix}{layer}.alpha"

    path = tmp_path / "dots.safetensors"
    qkv = "layers.0.attention.qkv"
    expected = write_file(path, "z-image", {qkv: FILE_LAYERS["z-image"][qkv]}, dotted)
    assert_deltas(dense_deltas(load(path, "z-image"), "z-image"), expected)


def _diffusers_reading(family: str, path: Path) -> dict[str, torch.Tensor]:
    """Each diffusers layer's ΔW as diffusers' own converter reads the file (the alphas baked into the factors)."""
    import diffusers
    from safetensors.torch import load_file

    pipeline = {"qwen-image": "QwenImagePipeline", "z-image": "ZImagePipeline", "flux2": "Flux2Pipeline"}[family]
    converted = getattr(diffusers, pipeline).lora_state_dict(load_file(str(path)))
    return {key.removeprefix("transformer.").removesuffix(".lora_A.weight"):
            converted[key.replace(".lora_A.", ".lora_B.")] @ value
            for key, value in converted.items() if key.endswith(".lora_A.weight")}  # fmt: skip


# What diffusers' converters leave out of the file layers above, in layouts they read: FLUX.2's kohya converter
# knows neither the shared modulations, guidance_in, the final modulation (whose halves it would not swap) nor
# diffusers-named layers beside BFL ones.
DIFFUSERS_MISSES = {
    ("flux2", "kohya"): {"double_stream_modulation_txt.linear", "single_stream_modulation.linear",
                         "time_guidance_embed.guidance_embedder.linear_2", "norm_out.linear",
                         "transformer_blocks.1.attn.to_k"},
}  # fmt: skip
# File layers diffusers' converters misname (Z-Image's: its original names outside the attention).
DIFFUSERS_MISNAMES = {("z-image", "kohya"): {"x_embedder", "final_layer.linear", "final_layer.adaLN_modulation.1"}}


@pytest.mark.parametrize(("family", "layout"), [("qwen-image", "kohya"), ("qwen-image", "comfy lora_down"),
                                                ("z-image", "kohya"), ("flux2", "kohya")])  # fmt: skip
def test_where_diffusers_reads_a_layout_it_means_the_same(tmp_path: Path, family: str, layout: str) -> None:
    misnamed = DIFFUSERS_MISNAMES.get((family, layout), set())
    file_layers = {name: targets for name, targets in FILE_LAYERS[family].items() if name not in misnamed}
    path = tmp_path / "adapter.safetensors"
    write_file(path, family, file_layers, LAYOUTS[layout], seed=1)
    ours = dense_deltas(load(path, family), family)
    theirs = _diffusers_reading(family, path)
    assert set(theirs) == set(ours) - DIFFUSERS_MISSES.get((family, layout), set())
    for module, delta in theirs.items():
        torch.testing.assert_close(ours[module], delta, rtol=1e-5, atol=1e-5, msg=module)


def test_a_lycoris_kind_in_comfy_names_is_read(tmp_path: Path) -> None:
    """A LoHa on BFL's fused qkv, ComfyUI-prefixed: diffusers' converters read no LoHa, the kohya reader does, cut
    by rows like a LoRA."""
    generator = torch.Generator().manual_seed(2)
    w1a, w1b, w2a, w2b = (torch.randn(shape, generator=generator) for shape in ((72, 2), (2, 24), (72, 2), (2, 24)))
    layer = "diffusion_model.double_blocks.0.img_attn.qkv"
    path = tmp_path / "loha.safetensors"
    save_file({f"{layer}.hada_w1_a": w1a, f"{layer}.hada_w1_b": w1b, f"{layer}.hada_w2_a": w2a,
               f"{layer}.hada_w2_b": w2b, f"{layer}.alpha": torch.tensor(1.0)}, str(path))  # fmt: skip
    adapter = load(path, "flux2")
    assert adapter.kinds == ("loha",)
    delta = (w1a @ w1b) * (w2a @ w2b) * 0.5
    expected = {module: delta[rows[0][0] : rows[0][1]] for module, rows in _stacked("transformer_blocks.0.attn", QKV)}
    assert_deltas(dense_deltas(adapter, "flux2"), expected)


def test_without_fusing_a_comfy_file_of_slot_layers_fits_the_slot_and_others_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "slot.safetensors"
    write_file(path, "flux2", {"double_blocks.0.img_attn.qkv": FILE_LAYERS["flux2"]["double_blocks.0.img_attn.qkv"]},
               LAYOUTS["comfy lora_A"])  # fmt: skip
    adapter = load(path, "flux2", fuse=False)
    assert adapter.fits_slot and set(adapter.layers) == {f"transformer_blocks.0.attn.{name}" for name in QKV}
    write_file(path, "flux2", {"img_in": FILE_LAYERS["flux2"]["img_in"]}, LAYOUTS["comfy lora_A"])
    with pytest.raises(AdapterIncompatibleError) as refused:
        load(path, "flux2", fuse=False)
    assert refused.value.reason == "ADAPTER_LAYER_NOT_TARGETED"


def test_a_layer_in_two_layouts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.safetensors"
    down, up = torch.randn(RANK, 24), torch.randn(24, RANK)
    save_file({"diffusion_model.layers.0.attention.to_q.lora_A.weight": down,
               "diffusion_model.layers.0.attention.to_q.lora_B.weight": up,
               "lora_unet_layers_0_attention_to_q.lora_down.weight": down.clone(),
               "lora_unet_layers_0_attention_to_q.lora_up.weight": up.clone()}, str(path))  # fmt: skip
    with pytest.raises(AdapterFormatError) as refused:
        load(path, "z-image")
    assert refused.value.reason == "ADAPTER_MALFORMED"
    assert "twice" in str(refused.value)


@pytest.mark.parametrize(("down", "up"), [
    ("diffusion_model.layers.0.attention.to_q.lora_A.weight", "lora_unet_layers_0_attention_to_q.lora_up.weight"),
    ("diffusion_model.layers.0.attention.to_q.lora_down.weight", "lora_unet_layers_0_attention_to_q.lora_up.weight"),
    ("diffusion_model.layers.0.attention.to_q.lora_A.weight",
     "base_model.model.layers.0.attention.to_q.lora_B.weight"),
])  # fmt: skip
def test_one_layer_spelled_twice_for_its_two_factors_is_refused(tmp_path: Path, down: str, up: str) -> None:
    """Each factor once, under two spellings of the layer: read as one layer, it would be made of both."""
    path = tmp_path / "halves.safetensors"
    save_file({down: torch.randn(RANK, 24), up: torch.randn(24, RANK)}, str(path))
    with pytest.raises(AdapterFormatError) as refused:
        load(path, "z-image")
    assert refused.value.reason == "ADAPTER_MALFORMED"
    assert "twice" in str(refused.value) and "lora_unet_layers_0_attention_to_q" in str(refused.value)


@pytest.mark.parametrize("layout", ["kohya", "comfy lora_A"])
@pytest.mark.parametrize(("family", "fused", "part"), [
    ("flux2", "double_blocks.0.img_attn.qkv", "transformer_blocks.0.attn.to_q"),
    ("z-image", "layers.0.attention.qkv", "layers.0.attention.to_q"),
])  # fmt: skip
def test_a_fused_layer_beside_one_of_its_parts_is_refused(tmp_path: Path, layout, family, fused, part) -> None:
    """Either would be dropped unseen (diffusers' Z-Image converter drops the qkv; the kohya reader would keep one)."""
    path = tmp_path / "both.safetensors"
    write_file(path, family, {fused: FILE_LAYERS[family][fused], **_whole(part)}, LAYOUTS[layout])
    with pytest.raises(AdapterFormatError) as refused:
        load(path, family)
    assert refused.value.reason == "ADAPTER_MALFORMED"
    assert "twice" in str(refused.value) and part in str(refused.value)


def test_keys_no_converter_reads_are_refused_saying_which_layouts_are_read(tmp_path: Path) -> None:
    """ai-toolkit's FLUX.1 kohya prefix on FLUX.2: its kohya converter returns nothing (only a warning)."""
    path = tmp_path / "unknown.safetensors"
    save_file({"lora_transformer_single_transformer_blocks_0_attn_to_out.lora_down.weight": torch.randn(RANK, 96),
               "lora_transformer_single_transformer_blocks_0_attn_to_out.lora_up.weight": torch.randn(24, RANK)},
              str(path))  # fmt: skip
    with pytest.raises(AdapterFormatError) as refused:
        load(path, "flux2")
    assert refused.value.reason == "ADAPTER_MALFORMED"
    assert "lora_unet_" in str(refused.value) and "diffusion_model." in str(refused.value)


def test_an_alpha_of_many_values_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "alpha.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(RANK, 24),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(24, RANK),
               "transformer.transformer_blocks.0.attn.to_q.alpha": torch.ones(2)}, str(path))  # fmt: skip
    with pytest.raises(AdapterFormatError) as refused:
        load(path, "qwen-image")
    assert refused.value.reason == "ADAPTER_SHAPE_MISMATCH"


def test_messages_name_layers_as_the_file_spells_them(tmp_path: Path) -> None:
    path = tmp_path / "incomplete.safetensors"
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(RANK, 24)}, str(path))
    with pytest.raises(AdapterFormatError) as refused:
        load(path, "flux2")
    assert "diffusion_model.double_blocks.0.img_attn.qkv" in str(refused.value)


@pytest.mark.parametrize("family", [ModelFamily.FLUX, ModelFamily.SDXL])
def test_flux1_and_sdxl_files_reach_their_readers_as_before(family: ModelFamily) -> None:
    """The renames are the newer families' only: FLUX.1's and SDXL's ComfyUI-style and diffusers-named files reach
    diffusers' converters as they always did."""
    state = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.ones(1, 1),
             "transformer_blocks.0.attn.to_q.lora_A.default.weight": torch.ones(1, 1),
             "transformer.transformer_blocks.0.attn.to_q.alpha": torch.tensor(1.0)}  # fmt: skip
    renamed, spellings = comfy_as_kohya(state, family)
    assert renamed is state and spellings == {}
    keys, alphas = normalised_keys(state, family, "transformer", {"transformer_blocks.0.attn.to_q": None})
    assert keys is state and alphas is None  # the very dict: a converter that consumes it does as before


def test_a_fusing_server_refuses_a_layer_the_model_lacks_without_telling_it_to_fuse(tmp_path: Path) -> None:
    # The tiny transformer has blocks 0 and 1: block 7's to_k is no layer of it, which no restart would serve.
    path = tmp_path / "elsewhere.safetensors"
    down, up = torch.randn(RANK, 24), torch.randn(24, RANK)
    save_file({f"transformer.transformer_blocks.{block}.attn.to_k.lora_{factor}.weight": tensor.clone()
               for block in (0, 7) for factor, tensor in (("A", down), ("B", up))}, str(path))  # fmt: skip
    with pytest.raises(AdapterIncompatibleError) as refused:
        load(path, "flux2")  # fusing: a layer outside the slot would be merged
    assert refused.value.reason == "ADAPTER_LAYER_NOT_TARGETED"
    assert "transformer_blocks.7.attn.to_k" in refused.value.message
    assert "no layer of this model" in refused.value.message and "--fuse" not in refused.value.message


@pytest.mark.parametrize("family", ["qwen-image", "flux2"])
def test_alphas_in_diffusers_names_mean_what_they_mean_in_kohya_names(tmp_path: Path, family: str) -> None:
    # Per layer: its own alpha; none, or 0, is alpha = rank. One file means one thing in every spelling.
    generator = torch.Generator().manual_seed(5)
    alphas = {"to_q": 0.0, "to_k": None, "to_v": 1.5}
    expected, diffusers_named, kohya_named = {}, {}, {}
    for name, alpha in alphas.items():
        module = f"transformer_blocks.0.attn.{name}"
        down, up = torch.randn(RANK, 24, generator=generator), torch.randn(24, RANK, generator=generator)
        expected[module] = up @ down * ((alpha or RANK) / RANK)
        diffusers_named |= {f"transformer.{module}.lora_A.weight": down, f"transformer.{module}.lora_B.weight": up}
        kohya_named |= {f"lora_unet_{_flat(module)}.lora_down.weight": down.clone(),
                        f"lora_unet_{_flat(module)}.lora_up.weight": up.clone()}  # fmt: skip
        if alpha is not None:
            diffusers_named[f"transformer.{module}.alpha"] = torch.tensor(alpha)
            kohya_named[f"lora_unet_{_flat(module)}.alpha"] = torch.tensor(alpha)
    for spelling, tensors in (("diffusers", diffusers_named), ("kohya", kohya_named)):
        path = tmp_path / f"{spelling}.safetensors"
        save_file(tensors, str(path))
        assert_deltas(dense_deltas(load(path, family), family), expected)
