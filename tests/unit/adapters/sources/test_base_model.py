"""Base-model declarations: one vocabulary for every dialect, the compatibility rule, and hostile metadata.

Real safetensors files and model cards in a temp dir; the integration test (tests/integration/test_base_model.py)
shows the refusal through a real server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.sources import (
    FLUX_DEV,
    FLUX_SCHNELL,
    MAX_CARD_BASES,
    MAX_DECLARATION_CHARS,
    SDXL_BASE,
    SOURCE_BASE_MODEL,
    SOURCE_KOHYA,
    SOURCE_MODEL_CARD,
    SOURCE_MODELSPEC,
    AdapterFile,
    BaseModel,
    BaseModelPolicy,
    LocalAdapterDirectory,
    normalise,
    read_declarations,
    read_safetensors_metadata,
)
from loraswap.server.engine.errors import AdapterFormatError, BaseModelMismatchError, ErrorReason
from loraswap.server.engine.models import BUILTINS, served_base_model

SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"


# What each dialect writes, and the id it means.
SPELLINGS = [
    # Hub ids, as model cards and diffusers write them, in any case and with hf:/URL forms.
    (SDXL_BASE, SDXL_BASE),
    ("StabilityAI/Stable-Diffusion-XL-Base-1.0", SDXL_BASE),
    ("https://huggingface.co/black-forest-labs/FLUX.1-dev", FLUX_DEV),
    ("hf:black-forest-labs/FLUX.1-schnell", FLUX_SCHNELL),
    ("runwayml/stable-diffusion-v1-5", SD15),
    # ModelSpec architectures (kohya's sai_model_spec.py), with and without the adapter kind.
    ("stable-diffusion-xl-v1-base/lora", SDXL_BASE),
    ("stable-diffusion-xl-v1-base", SDXL_BASE),
    ("flux-1-dev/lora", FLUX_DEV),
    ("Flux.1-dev/lora", FLUX_DEV),
    ("flux-1-schnell/lora", FLUX_SCHNELL),
    ("flux-1/lora", "flux1"),
    ("stable-diffusion-v1/lora", "sd1"),
    ("stable-diffusion-xl-v1-refiner/lora", "stabilityai/stable-diffusion-xl-refiner-1.0"),
    # kohya's ss_base_model_version.
    ("sdxl_base_v1-0", SDXL_BASE),
    ("flux1", "flux1"),
    ("sd_v1", "sd1"),
    ("sd_v2_v", "sd2"),
    ("chroma", "lodestones/Chroma"),
    # Unknown: taken verbatim as a Hub id of its own (only a slash-suffix ModelSpec adapter kind is dropped).
    ("my-org/flux-finetune", "my-org/flux-finetune"),
    ("flux-2-finetune/lora", "flux-2-finetune"),
    # The newer families as musubi-tuner's ModelSpec writes them, and Hub ids.
    ("Qwen-Image/lora", "Qwen/Qwen-Image"),
    ("Qwen-Image-Edit-Plus/lora", "Qwen/Qwen-Image-Edit-2509"),
    ("Qwen-Image-Edit-2511/lora", "Qwen/Qwen-Image-Edit-2511"),
    ("Z-Image/lora", "Tongyi-MAI/Z-Image"),
    ("Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image-Turbo"),
    ("Flux.2-dev/lora", "black-forest-labs/FLUX.2-dev"),
    ("Flux.2-klein-4b/lora", "black-forest-labs/FLUX.2-klein-4B"),
    ("flux2-klein-9b/lora", "black-forest-labs/FLUX.2-klein-9B"),
    ("  sdxl_base_v1-0  ", SDXL_BASE),
]


@pytest.mark.parametrize(("declared", "expected"), SPELLINGS)
def test_every_dialect_normalises_onto_one_vocabulary(declared: str, expected: str) -> None:
    assert normalise(declared).id == expected


# (adapter declares, server serves, fits)
FITS = [
    (SDXL_BASE, SDXL_BASE, True),
    ("sdxl_base_v1-0", SDXL_BASE, True),
    (SDXL_BASE, FLUX_DEV, False),  # the example: an SDXL LoRA on Flux
    ("stable-diffusion-xl-v1-base/lora", FLUX_DEV, False),
    (FLUX_SCHNELL, FLUX_DEV, True),  # one group: FLUX.1 dev and schnell LoRAs are used on each other
    (FLUX_DEV, FLUX_SCHNELL, True),
    ("flux1", FLUX_DEV, True),  # a family name fits any model of the family
    ("flux1", FLUX_SCHNELL, True),
    ("flux1", SDXL_BASE, False),
    ("flux1", "lodestones/Chroma", False),  # pruned: not FLUX.1's group
    ("stabilityai/stable-diffusion-xl-refiner-1.0", SDXL_BASE, False),
    ("sd_v1", SDXL_BASE, False),
    ("CompVis/stable-diffusion-v1-4", SD15, True),
    ("my-org/flux-finetune", FLUX_DEV, False),  # unknown: only itself
    ("My-Org/Flux-Finetune", "my-org/flux-finetune", True),
    (FLUX_DEV, "my-org/flux-finetune", False),
    ("flux1", "loraswap/shapes", False),
    ("Z-Image/lora", "Tongyi-MAI/Z-Image-Turbo", True),  # Turbo is distilled from Base: one transformer
    ("Qwen-Image/lora", "Qwen/Qwen-Image-2512", True),
    ("Qwen-Image-Edit-Plus/lora", "Qwen/Qwen-Image", False),  # Edit models are trained on other inputs
    ("Qwen-Image-Edit-Plus/lora", "Qwen/Qwen-Image-Edit-2511", True),
    ("Flux.2-klein-4b/lora", "black-forest-labs/FLUX.2-klein-base-4B", True),
    ("Flux.2-klein-4b/lora", "black-forest-labs/FLUX.2-klein-9B", False),  # other widths
    ("Flux.2-dev/lora", "black-forest-labs/FLUX.2-klein-9B", False),
    ("flux1", "black-forest-labs/FLUX.2-dev", False),
]


@pytest.mark.parametrize(("declared", "served", "fits"), FITS)
def test_compatibility(declared: str, served: str, fits: bool) -> None:
    assert normalise(declared).fits(normalise(served)) is fits
    assert normalise(served).fits(normalise(declared)) is fits  # symmetric


def _adapter(tmp_path: Path, metadata: dict[str, str] | None = None, card: str | None = None) -> AdapterFile:
    """A real (tiny) safetensors file with `metadata`, in a folder of its own with `card` as README.md."""
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    path = folder / "pytorch_lora_weights.safetensors"
    save_file({"x.lora_A.weight": torch.zeros(2, 4)}, str(path), metadata=metadata)
    card_path = None
    if card is not None:
        card_path = folder / "README.md"
        card_path.write_text(card)
    return AdapterFile(
        name="adapter", path=path, source="adapter/pytorch_lora_weights.safetensors", model_card=card_path
    )


def _card(front_matter: str) -> str:
    return f"---\n{front_matter}\n---\n\n# An adapter\n\nTrained with care.\n"


@pytest.mark.parametrize(
    ("metadata", "card", "source", "declared", "ids"),
    [
        ({"base_model": SDXL_BASE}, None, SOURCE_BASE_MODEL, SDXL_BASE, (SDXL_BASE,)),
        ({"modelspec.architecture": "flux-1-dev/lora"}, None, SOURCE_MODELSPEC, "flux-1-dev/lora", (FLUX_DEV,)),
        ({"ss_base_model_version": "flux1"}, None, SOURCE_KOHYA, "flux1", ("flux1",)),
        (None, _card(f"base_model: {SDXL_BASE}\ntags: [lora]"), SOURCE_MODEL_CARD, SDXL_BASE, (SDXL_BASE,)),
        (None, _card(f"base_model:\n- {FLUX_DEV}\n- {FLUX_SCHNELL}"), SOURCE_MODEL_CARD,
         f"{FLUX_DEV}, {FLUX_SCHNELL}", (FLUX_DEV, FLUX_SCHNELL)),
    ],
    ids=["safetensors-base_model", "modelspec", "kohya", "model-card", "model-card-list"],
)  # fmt: skip
def test_each_declaration_source_is_read(tmp_path, metadata, card, source, declared, ids) -> None:
    (declaration,) = read_declarations(_adapter(tmp_path, metadata, card))
    assert (declaration.source, declaration.declared) == (source, declared)
    assert tuple(base.id for base in declaration.bases) == ids


def test_only_the_base_model_lines_of_a_card_are_parsed(tmp_path) -> None:
    """The rest of the front matter may be anything (here brackets nested 20 000 deep) and costs nothing."""
    card = _card("widget: " + "[" * 20_000 + "]" * 20_000 + f"\nbase_model: {FLUX_DEV}\ntags:\n- lora")
    (declaration,) = read_declarations(_adapter(tmp_path, None, card))
    assert declaration.bases == (BaseModel(FLUX_DEV, "flux1"),)


def test_kohya_files_declare_twice_and_both_are_read(tmp_path) -> None:
    metadata = {
        "modelspec.architecture": "stable-diffusion-xl-v1-base/lora",
        "ss_base_model_version": "sdxl_base_v1-0",
        "ss_network_dim": "16",
    }
    declarations = read_declarations(_adapter(tmp_path, metadata))
    assert [(d.source, d.bases) for d in declarations] == [
        (SOURCE_MODELSPEC, (BaseModel(SDXL_BASE, "sdxl"),)),
        (SOURCE_KOHYA, (BaseModel(SDXL_BASE, "sdxl"),)),
    ]


@pytest.mark.parametrize(
    ("metadata", "card"),
    [
        (None, None),
        ({"format": "pt", "lora_adapter_metadata": "{}"}, None),  # what diffusers writes: no base
        ({"base_model": "   "}, None),  # empty: no declaration
        (None, "# A card without front matter\n\nbase_model: not front matter\n"),
        (None, _card("license: mit")),
        (None, _card("base_model: [unclosed")),  # not YAML: a card is prose for people, it declares nothing
        (None, _card("- a list, not a mapping")),
        # A billion-laughs card: aliases are never expanded, the card declares nothing.
        (None, _card('a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
                     "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nbase_model: *c")),
        (None, _card(f"base_model:\n- &a {SDXL_BASE}\n- *a")),
    ],
    ids=["nothing", "diffusers-metadata", "empty", "no-front-matter", "no-base", "bad-yaml", "not-mapping",
         "alias-bomb", "alias-in-declaration"],
)  # fmt: skip
def test_no_declaration(tmp_path, metadata, card) -> None:
    adapter = _adapter(tmp_path, metadata, card)
    assert read_declarations(adapter) == ()
    BaseModelPolicy(FLUX_DEV).check(adapter)  # accepted as before base models were read


@pytest.mark.parametrize(
    ("metadata", "card", "named"),
    [
        ({"base_model": "x" * (MAX_DECLARATION_CHARS + 1)}, None, SOURCE_BASE_MODEL),
        ({"ss_base_model_version": "sdxl\x00base"}, None, SOURCE_KOHYA),
        (None, _card("base_model: 42"), SOURCE_MODEL_CARD),
        (None, _card("base_model: {repo: " + SDXL_BASE + "}"), SOURCE_MODEL_CARD),
        (None, _card("base_model: [" + ", ".join(["a/b"] * (MAX_CARD_BASES + 1)) + "]"), "base models"),
        (None, _card(f"base_model: [{SDXL_BASE}, 7]"), SOURCE_MODEL_CARD),
        # Nested brackets take PyYAML's scanner seconds per few kilobytes: refused before it sees them.
        (None, _card("base_model: " + "[" * 5000 + "]" * 5000), SOURCE_MODEL_CARD),
        (None, _card("base_model:\n" + f"- {SDXL_BASE}\n" * 400), SOURCE_MODEL_CARD),
    ],
    ids=["over-long", "control-character", "number", "mapping", "too-many", "list-with-number", "nested",
         "long-block"],
)  # fmt: skip
def test_a_declaration_that_is_not_a_model_id_is_bad_metadata(tmp_path, metadata, card, named) -> None:
    with pytest.raises(AdapterFormatError) as caught:
        BaseModelPolicy(FLUX_DEV).check(_adapter(tmp_path, metadata, card))
    assert caught.value.reason is ErrorReason.ADAPTER_BAD_METADATA
    assert named in caught.value.message and len(caught.value.message) < 500


def _raw_file(path: Path, header: bytes, length: int | None = None) -> Path:
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + b"\0" * 16)
    return path


@pytest.mark.parametrize(
    ("header", "length"),
    [
        (b"not json", None),
        (b'["a list"]', None),
        (b'{"__metadata__": "a string"}', None),
        (b'{"__metadata__": {"base_model": "' + SDXL_BASE.encode() + b'"}}', 1 << 60),  # claims an exabyte
        (b"", 0),
        (b"[" * 100_000 + b"]" * 100_000, None),
    ],
    ids=["not-json", "not-object", "metadata-not-object", "huge-length", "empty", "deep-json"],
)
def test_an_unreadable_header_declares_nothing(tmp_path, header: bytes, length: int | None) -> None:
    assert read_safetensors_metadata(_raw_file(tmp_path / "a.safetensors", header, length)) == {}


def test_the_header_is_read_without_the_tensors(tmp_path) -> None:
    """A file whose tensors are cut off still declares its base: the check needs the header only."""
    header = json.dumps(
        {
            "__metadata__": {"base_model": SDXL_BASE},
            "w": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]},
        }
    ).encode()
    path = _raw_file(tmp_path / "cut.safetensors", header)
    adapter = AdapterFile(name="cut", path=path, source="cut.safetensors")
    with pytest.raises(BaseModelMismatchError) as caught:
        BaseModelPolicy(FLUX_DEV).check(adapter)
    assert caught.value.metadata == {
        "adapter_base": SDXL_BASE, "served_base": FLUX_DEV, "source": SOURCE_BASE_MODEL,
    }  # fmt: skip
    assert "--allow-base" in caught.value.message and SDXL_BASE in caught.value.message


def test_policy_refuses_a_mismatch_and_allow_base_accepts_it(tmp_path) -> None:
    adapter = _adapter(tmp_path, {"modelspec.architecture": "stable-diffusion-xl-v1-base/lora"})
    with pytest.raises(BaseModelMismatchError) as caught:
        BaseModelPolicy(FLUX_DEV).check(adapter)
    error = caught.value
    assert error.reason is ErrorReason.BASE_MODEL_MISMATCH
    assert error.metadata == {"adapter_base": SDXL_BASE, "served_base": FLUX_DEV, "source": SOURCE_MODELSPEC}
    assert f"--allow-base {SDXL_BASE}" in error.message and "'stable-diffusion-xl-v1-base/lora'" in error.message
    # --allow-base goes through the same table: any spelling of the base allows it.
    BaseModelPolicy(FLUX_DEV, ["sdxl_base_v1-0"]).check(adapter)
    BaseModelPolicy(FLUX_DEV, [SDXL_BASE]).check(adapter)
    with pytest.raises(BaseModelMismatchError):
        BaseModelPolicy(FLUX_DEV, ["stabilityai/stable-diffusion-xl-refiner-1.0", " "]).check(adapter)


def test_every_declaration_must_fit_and_one_of_a_list_is_enough(tmp_path) -> None:
    agreeing = _adapter(tmp_path, {"ss_base_model_version": "flux1"}, _card(f"base_model: [{SDXL_BASE}, {FLUX_DEV}]"))
    BaseModelPolicy(FLUX_SCHNELL).check(agreeing)
    conflicting = _adapter(tmp_path, {"base_model": FLUX_DEV}, _card(f"base_model: {SDXL_BASE}"))
    with pytest.raises(BaseModelMismatchError) as caught:
        BaseModelPolicy(FLUX_DEV).check(conflicting)
    assert caught.value.metadata["source"] == SOURCE_MODEL_CARD


def test_unknown_served_base_accepts_only_itself_and_what_is_allowed(tmp_path) -> None:
    adapter = _adapter(tmp_path, {"base_model": FLUX_DEV})
    with pytest.raises(BaseModelMismatchError):
        BaseModelPolicy("my-org/flux-finetune").check(adapter)
    BaseModelPolicy("my-org/flux-finetune", ["black-forest-labs/FLUX.1-dev"]).check(adapter)
    # What --allow-base X allows is what serving X would: a family name too.
    BaseModelPolicy("my-org/flux-finetune", [FLUX_SCHNELL]).check(
        _adapter(tmp_path, {"ss_base_model_version": "flux1"})
    )


@pytest.mark.parametrize(
    ("model", "base"),
    [("shapes", "loraswap/shapes"), ("tiny-flux", FLUX_DEV), ("random-flux", FLUX_DEV),
     ("tiny-sdxl", SDXL_BASE), ("random-sdxl", SDXL_BASE), ("someone/some-model", "someone/some-model")],
)  # fmt: skip
def test_served_base_of_builtins_and_hub_ids(model: str, base: str) -> None:
    assert served_base_model(model) == base


def test_every_builtin_declares_a_base_in_the_vocabulary() -> None:
    for name, builtin in BUILTINS.items():
        assert normalise(builtin.base_model).id == builtin.base_model, name


def test_served_base_of_a_folder(tmp_path) -> None:
    named = tmp_path / "saved"
    named.mkdir()
    (named / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline", "_name_or_path": FLUX_DEV}))
    assert served_base_model(str(named)) == FLUX_DEV
    plain = tmp_path / "my-finetune"
    plain.mkdir()
    (plain / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert served_base_model(str(plain)) == "my-finetune"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text("[not an object")
    assert served_base_model(str(broken)) == "broken"


def test_local_model_card_is_the_adapter_folders_own(tmp_path) -> None:
    root = tmp_path / "adapters"
    (root / "styled").mkdir(parents=True)
    save_file({"x": torch.zeros(1)}, str(root / "styled" / "pytorch_lora_weights.safetensors"))
    (root / "styled" / "README.md").write_text(_card(f"base_model: {SDXL_BASE}"))
    save_file({"x": torch.zeros(1)}, str(root / "loose.safetensors"))
    (root / "README.md").write_text(_card(f"base_model: {SDXL_BASE}"))  # the directory's, not loose's
    directory = LocalAdapterDirectory(root)
    assert directory.find("styled").model_card == root / "styled" / "README.md"
    assert directory.find("loose").model_card is None


@pytest.mark.parametrize(
    ("model", "fits", "refused"),
    [("tiny-qwen-image", "Qwen-Image/lora", "Qwen-Image-Edit-Plus/lora"),
     ("tiny-z-image", "Z-Image/lora", "Flux.2-klein-4b/lora"),
     ("tiny-flux2", "Flux.2-dev/lora", "Flux.2-klein-9b/lora"),
     ("tiny-flux2-klein", "Flux.2-klein-4b/lora", "Flux.2-dev/lora")],
)  # fmt: skip
def test_the_newer_families_builtins_take_their_own_bases_musubi_files(tmp_path, model, fits, refused) -> None:
    # What musubi-tuner writes in modelspec.architecture, checked against the base the built-in serves.
    policy = BaseModelPolicy(served_base_model(model))
    policy.check(_adapter(tmp_path, {"modelspec.architecture": fits}))
    with pytest.raises(BaseModelMismatchError) as caught:
        policy.check(_adapter(tmp_path, {"modelspec.architecture": refused}))
    assert caught.value.reason == ErrorReason.BASE_MODEL_MISMATCH and repr(refused) in caught.value.message
