"""The built-in model registry: each model's facts, the refusals, and what any other --model name means.

Nothing here builds a full-size model: refusals happen before any weight exists.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from loraswap.server.engine.models import (
    BUILTINS,
    GENERATION_DEFAULTS_FILE,
    builtin_model,
    default_dtype,
    generation_defaults,
    load_pipeline,
    save_model_folder,
)
from loraswap.server.engine.types import ModelDefaults

# name: (generation defaults as written to loraswap_generation.json, dtype when --dtype is unset,
#        ships adapters, takes --layers, written by export-model)
EXPECTED = {
    "shapes": (
        {"width": 64, "height": 64, "num_inference_steps": 20, "guidance_scale": 1.0, "max_sequence_length": 16,
         "true_cfg_scale": 3.0},
        None, True, False, True,
    ),
    "tiny-flux": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 3.5, "max_sequence_length": 32},
        None, False, False, True,
    ),
    "tiny-sdxl": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 5.0},
        None, False, False, True,
    ),
    "random-flux": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 3.5, "max_sequence_length": 32},
        "bfloat16", False, True, False,
    ),
    "random-sdxl": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 5.0},
        "bfloat16", False, False, False,
    ),
    "tiny-qwen-image": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 32},
        None, False, False, True,
    ),
    "tiny-z-image": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 0.0, "max_sequence_length": 32},
        None, False, False, True,
    ),
    "tiny-flux2": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 64},
        None, False, False, True,
    ),
    "tiny-flux2-klein": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "max_sequence_length": 32},
        None, False, False, True,
    ),
    "random-qwen-image": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 32},
        "bfloat16", False, True, False,
    ),
    "random-z-image": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 0.0, "max_sequence_length": 32},
        "bfloat16", False, True, False,
    ),
    "random-flux2-klein": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 1.0, "max_sequence_length": 32},
        "bfloat16", False, True, False,
    ),
}  # fmt: skip
# What --layers applies to, as its refusal names them.
LAYERED = "random-flux, random-qwen-image, random-z-image and random-flux2-klein"


def test_the_registry_lists_every_builtin_with_shapes_first():
    assert list(BUILTINS) == list(EXPECTED)
    assert all(name == model.name for name, model in BUILTINS.items())


@pytest.mark.parametrize("name", EXPECTED)
def test_facts(name):
    defaults, dtype, ships_adapters, takes_layers, exportable = EXPECTED[name]
    model = builtin_model(name)
    assert model.defaults.to_dict() == defaults
    assert ModelDefaults.from_dict(defaults) == model.defaults
    assert model.dtype == dtype
    assert (model.adapter_dir is not None, model.takes_layers, model.exportable) == (
        ships_adapters, takes_layers, exportable
    )  # fmt: skip


def test_shapes_ships_its_demo_adapters():
    adapter_dir = builtin_model("shapes").adapter_dir
    for name in ("outline", "swap-colors", "purple"):
        assert (adapter_dir / name / "pytorch_lora_weights.safetensors").is_file()


def test_unknown_name_lists_the_builtins():
    with pytest.raises(ValueError) as caught:
        builtin_model("tiny-sd15")
    assert str(caught.value) == (
        "unknown builtin model 'tiny-sd15'; valid choices: shapes, tiny-flux, tiny-sdxl, random-flux, random-sdxl, "
        "tiny-qwen-image, tiny-z-image, tiny-flux2, tiny-flux2-klein, random-qwen-image, random-z-image, "
        "random-flux2-klein"
    )


@pytest.mark.parametrize("name", [name for name, facts in EXPECTED.items() if not facts[3]])
def test_layers_are_refused_where_they_do_not_apply(name):
    with pytest.raises(ValueError) as caught:
        load_pipeline(name, None, layers=2)
    assert str(caught.value) == f"--layers applies to {LAYERED} only, not to {name!r}"


def test_layers_are_refused_for_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match=rf"--layers applies to {LAYERED} only, not to '.*model'"):
        load_pipeline(str(tmp_path / "model"), None, layers=2)


@pytest.mark.parametrize("layers", [0, 20])
def test_layers_out_of_range_are_refused_before_building(layers):
    with pytest.raises(ValueError, match="use 1 to 19 double-stream blocks"):
        builtin_model("random-flux").build(layers=layers)


@pytest.mark.parametrize("name", [name for name, facts in EXPECTED.items() if not facts[4]])
def test_full_size_models_are_not_exported(name, tmp_path):
    with pytest.raises(ValueError, match="exportable models: shapes, tiny-flux, tiny-sdxl"):
        builtin_model(name).export(tmp_path / name)
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize(
    ("model", "device_type", "expected"),
    [
        ("tiny-flux", "cpu", "float32"),
        ("tiny-flux", "cuda", "bfloat16"),
        ("shapes", "cpu", "float32"),
        ("random-flux", "cpu", "bfloat16"),
        ("random-sdxl", "cpu", "bfloat16"),
        ("some/folder", "cpu", "float32"),
        ("some/folder", "cuda", "bfloat16"),
    ],
)
def test_default_dtype(model, device_type, expected):
    assert default_dtype(model, device_type) == expected


def test_a_builtin_uses_its_registered_defaults():
    assert generation_defaults("random-sdxl", None) is BUILTINS["random-sdxl"].defaults


def test_a_model_folder_carries_its_defaults(tmp_path):
    class Saved:
        def save_pretrained(self, path, safe_serialization):
            assert safe_serialization

    defaults = ModelDefaults(96, 80, 12, 2.5, max_sequence_length=77, true_cfg_scale=4.0)
    folder = save_model_folder(Saved(), tmp_path / "model", defaults)
    assert json.loads((folder / GENERATION_DEFAULTS_FILE).read_text())["true_cfg_scale"] == 4.0
    assert generation_defaults(str(folder), None) == defaults


def test_registry_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BUILTINS["shapes"].takes_layers = True  # type: ignore[misc]


def test_the_registry_imports_without_torch():
    # The command line lists the built-in names in its help; that must not load torch or diffusers.
    code = (
        "import sys\n"
        "from loraswap.server.engine.models import BUILTINS\n"
        "assert BUILTINS\n"
        "assert not {'torch', 'diffusers'} & set(sys.modules), 'torch or diffusers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_model_folder_is_named_by_what_it_was_saved_from_or_its_own_name_never_its_path(tmp_path) -> None:
    """GetServerInfo.model: no absolute path of the server's machine reaches a caller."""
    import json

    from loraswap.server.engine.models import model_name

    saved = tmp_path / "srv" / "models" / "my-flux"
    saved.mkdir(parents=True)
    (saved / "model_index.json").write_text(json.dumps({"_name_or_path": "black-forest-labs/FLUX.1-dev"}))
    assert model_name(str(saved)) == "black-forest-labs/FLUX.1-dev"
    (saved / "model_index.json").write_text(json.dumps({"_name_or_path": str(tmp_path / "elsewhere")}))
    assert model_name(str(saved)) == "my-flux"
    (saved / "model_index.json").write_text("not json")
    assert model_name(str(saved)) == "my-flux"
    assert model_name("tiny-flux") == "tiny-flux" and model_name("org/some-model") == "org/some-model"
