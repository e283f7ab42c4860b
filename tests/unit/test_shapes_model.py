"""The `shapes` built-in model: it loads offline, draws deterministically, exports, and its classifier reads truth."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from safetensors import safe_open
from training.shapes_classifier import classify_image
from training.shapes_data import ADAPTER_STYLES, render, restyle, sample_scene
from transformers import CLIPTextModel, T5EncoderModel

from loraswap.server.engine.models import BUILTINS, GENERATION_DEFAULTS_FILE, builtin_model
from loraswap.server.engine.models.shapes import shapes_adapter_dir, shapes_weights_dir

PROMPT = "a red circle on a blue background"
ADAPTERS = ("outline", "swap-colors", "purple")


@pytest.fixture(scope="module")
def pipe() -> FluxPipeline:
    pipe = builtin_model("shapes").build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: FluxPipeline, prompt: str = PROMPT, seed: int = 0) -> np.ndarray:
    kwargs = builtin_model("shapes").defaults.to_dict()
    out = pipe(
        prompt, negative_prompt="", generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs
    ).images[0]
    return (out * 255).round().astype(np.uint8)


def test_shapes_is_the_first_builtin_and_uses_the_real_flux_classes(pipe: FluxPipeline) -> None:
    assert next(iter(BUILTINS)) == "shapes"
    assert isinstance(pipe, FluxPipeline) and pipe.name_or_path == "shapes"
    assert isinstance(pipe.transformer, FluxTransformer2DModel)
    assert isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.text_encoder, CLIPTextModel) and isinstance(pipe.text_encoder_2, T5EncoderModel)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.float32}


def test_defaults_carry_true_cfg() -> None:
    defaults = builtin_model("shapes").defaults
    assert (defaults.width, defaults.height) == (64, 64)
    assert defaults.true_cfg_scale > 1 and defaults.max_sequence_length == 16


def test_generation_is_deterministic_and_draws_the_prompt(pipe: FluxPipeline) -> None:
    first = generate(pipe)
    np.testing.assert_array_equal(first, generate(pipe))
    assert first.shape == (64, 64, 3)
    reading = classify_image(first)
    assert (reading.shape, reading.color, reading.background) == ("circle", "red", "blue")


def test_export_writes_a_plain_diffusers_folder(pipe: FluxPipeline, tmp_path) -> None:
    path = builtin_model("shapes").export(tmp_path / "shapes")
    assert (path / "model_index.json").is_file()
    assert not (path / "adapters").exists()
    assert json.loads((path / GENERATION_DEFAULTS_FILE).read_text()) == builtin_model("shapes").defaults.to_dict()
    loaded = FluxPipeline.from_pretrained(path, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    np.testing.assert_array_equal(generate(loaded), generate(pipe))


def test_shipped_weights_are_small_and_adapters_low_rank() -> None:
    files = [f for f in shapes_weights_dir().rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 12 * 2**20
    for name in ADAPTERS:
        weights = shapes_adapter_dir() / name / "pytorch_lora_weights.safetensors"
        with safe_open(weights, "pt") as f:
            ranks = {f.get_slice(key).get_shape()[0] for key in f.keys() if "lora_A" in key}  # noqa: SIM118 (safe_open is not a dict)
        assert ranks and max(ranks) <= 16, name


@pytest.mark.parametrize("style", ("base", *ADAPTER_STYLES))
def test_classifier_reads_the_generators_own_pictures(style: str) -> None:
    rng = np.random.default_rng(7)
    right = 0
    for _ in range(150):
        scene = restyle(sample_scene(rng), style)
        reading = classify_image(render(scene))
        right += reading.matches(scene.shape, scene.color, scene.background, hollow=scene.outline > 0)
    assert right / 150 >= 0.99
