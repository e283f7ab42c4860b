"""Text-encoder layers in the files of the families diffusers loads no text-encoder LoRA for (Qwen-Image, Z-Image,
FLUX.2), under each --text-encoder-layers: refused under apply saying what to do, dropped with a warning under
ignore (the transformer's layers read exactly as from the file without them), refused under --strict-adapters.

Each file is a tiny meta-device transformer's (family_models.py) LoRA with a text encoder's layers beside it, in
diffusers' names (`text_encoder.…`) and kohya's (`lora_te1_…`). FLUX.1's text-encoder layers, which its server
merges, are tested in test_canonical.py and test_kohya_formats.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.formats import CanonicalAdapter, SlotSpec, load_canonical, text_encoder_of
from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError
from tests.unit.adapters.formats.family_models import TINY, model, slot_spec

RANK = 2
# Per family, a slot layer (a plain LoRA of it goes into the slot) and one outside the slot (a change, fused).
LAYERS = {
    "qwen-image": ("transformer_blocks.0.attn.to_q", "img_in"),
    "z-image": ("layers.0.attention.to_q", "cap_embedder.1"),
    "flux2": ("transformer_blocks.0.attn.to_q", "x_embedder"),
}
# layout -> (the transformer's keys of a module path, the text encoder's tensors, how the file names that encoder and
# how many tensors it has there).
TEXT_ENCODER_MODULE = "model.layers.0.self_attn.q_proj"
LAYOUTS = {
    "diffusers": (
        lambda path: (f"transformer.{path}.lora_A.weight", f"transformer.{path}.lora_B.weight", None),
        {f"text_encoder.{TEXT_ENCODER_MODULE}.lora_A.weight": (RANK, 32),
         f"text_encoder.{TEXT_ENCODER_MODULE}.lora_B.weight": (32, RANK)},
        "text_encoder (2 tensors)",
    ),
    "kohya": (
        lambda path: tuple(f"lora_unet_{path.replace('.', '_')}.{name}"
                           for name in ("lora_down.weight", "lora_up.weight", "alpha")),
        {f"lora_te1_{TEXT_ENCODER_MODULE.replace('.', '_')}.{name}": shape
         for name, shape in (("lora_down.weight", (RANK, 32)), ("lora_up.weight", (32, RANK)), ("alpha", ()))},
        "lora_te1 (3 tensors)",
    ),
}  # fmt: skip


def _transformer_tensors(family: str, layout: str) -> dict[str, torch.Tensor]:
    _, _, layers = model(family, tiny=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for path in LAYERS[family]:
        out_features, in_features = layers.shape("transformer", path).weight
        down, up, alpha = LAYOUTS[layout][0](path)
        tensors[down] = torch.randn(RANK, in_features, generator=generator)
        tensors[up] = torch.randn(out_features, RANK, generator=generator)
        if alpha is not None:
            tensors[alpha] = torch.tensor(1.5)
    return tensors


def _text_encoder_tensors(layout: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {key: torch.randn(shape, generator=generator) for key, shape in LAYOUTS[layout][1].items()}


def _load(path: Path, spec: SlotSpec) -> CanonicalAdapter:
    return load_canonical(AdapterFile(name=path.stem, path=path, source=str(path)), spec)


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


FAMILIES = sorted(TINY)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_text_encoder_layers_are_refused_dropped_or_refused_strictly(tmp_path: Path, family: str, layout: str) -> None:
    transformer = _transformer_tensors(family, layout)
    path = _write(tmp_path / "with-te.safetensors", {**transformer, **_text_encoder_tensors(layout)})
    named = LAYOUTS[layout][2]
    applying = slot_spec(family, tiny=True)
    assert applying.text_encoder_layers == "apply" and not applying.merges_text_encoders

    # apply: nothing merges them, so the file is refused, naming them and saying how to serve the rest.
    with pytest.raises(AdapterFormatError) as refused:
        _load(path, applying)
    assert refused.value.reason == "ADAPTER_UNSUPPORTED_TENSORS"
    assert named in refused.value.message and "--text-encoder-layers ignore" in refused.value.message

    # ignore: dropped with a warning; the transformer's layers are read as from the file without them.
    ignoring = dataclasses.replace(applying, text_encoder_layers="ignore")
    dropped = _load(path, ignoring)
    (warning,) = dropped.warnings
    assert warning == f"dropped layers for {named}: text-encoder layers are ignored (--text-encoder-layers ignore)"
    alone = _load(_write(tmp_path / "alone.safetensors", transformer), ignoring)
    assert alone.warnings == () and dropped.layers_per_component("transformer") == {"transformer": 2}
    assert set(dropped.layers) == {LAYERS[family][0]} and set(dropped.changes) == {("transformer", LAYERS[family][1])}
    assert dropped.content_key == alone.content_key

    # ignore under --strict-adapters: refused, as FLUX.1's are.
    with pytest.raises(AdapterIncompatibleError) as strict:
        _load(path, dataclasses.replace(ignoring, strict=True))
    assert strict.value.reason == "ADAPTER_TEXT_ENCODER_LAYERS" and named in strict.value.message


@pytest.mark.parametrize("policy", ["apply", "ignore"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_file_of_text_encoder_layers_only_changes_no_denoiser_layer(tmp_path: Path, layout: str, policy) -> None:
    path = _write(tmp_path / "te-only.safetensors", _text_encoder_tensors(layout))
    with pytest.raises(AdapterFormatError) as refused:
        _load(path, dataclasses.replace(slot_spec("flux2", tiny=True), text_encoder_layers=policy))
    assert refused.value.reason == "ADAPTER_NO_DENOISER_LAYERS" and LAYOUTS[layout][2] in refused.value.message


@pytest.mark.parametrize("component", ["vae", "text_encoders", "lora_te9"])
def test_components_that_are_no_text_encoder_stay_refused_under_ignore(tmp_path: Path, component: str) -> None:
    tensors = {f"{component}.{TEXT_ENCODER_MODULE}.lora_A.weight": torch.randn(RANK, 32),
               f"{component}.{TEXT_ENCODER_MODULE}.lora_B.weight": torch.randn(32, RANK)}  # fmt: skip
    path = _write(tmp_path / "vae.safetensors", {**_transformer_tensors("qwen-image", "diffusers"), **tensors})
    with pytest.raises(AdapterFormatError) as refused:
        _load(path, dataclasses.replace(slot_spec("qwen-image", tiny=True), text_encoder_layers="ignore"))
    assert refused.value.reason == "ADAPTER_UNSUPPORTED_TENSORS" and f"{component} (2 tensors)" in refused.value.message


def test_every_familys_kohya_prefixes_agree_with_what_names_a_text_encoder_part() -> None:
    # The families that read text-encoder layers name their kohya prefixes in their traits; the families that take
    # none set apart what text_encoder_parts names. One rule must hold for both: a prefix is a text encoder's
    # exactly when text_encoder_of says so.
    from loraswap.server.engine.families import FAMILIES

    for traits in FAMILIES.values():
        for prefix, component in traits.kohya_prefixes.items():
            is_text_encoder = component in traits.text_encoders
            assert (text_encoder_of(f"{prefix}_text_model_encoder_layers_0_mlp_fc1.lora_down.weight") is not None) == (
                is_text_encoder
            ), (traits.family, prefix)
        for component in traits.text_encoders:
            assert text_encoder_of(f"{component}.text_model.encoder.layers.0.mlp.fc1.lora_A.weight") == component
        assert text_encoder_of(f"{traits.denoiser_attribute}.x.lora_A.weight") is None
