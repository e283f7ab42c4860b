"""Shared fixtures: real tiny pipelines, real PEFT-written adapters, real servers on port 0."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# Two cores at most here; oversubscribing them makes torch crawl (see DEVELOPERS.md).
TEST_TORCH_THREADS = 1
torch.set_num_threads(TEST_TORCH_THREADS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Image comparisons: decoded 8-bit RGB; the server's image and the fresh-diffusers
# reference may differ by float rounding (compiled graphs, padded rank), never by more.
MAX_PIXEL_DIFF = 3
MEAN_PIXEL_DIFF = 0.5
# Every adapter used in the swap tests changes the image by far more than that.
MIN_ADAPTER_EFFECT = 8

# Factor scales that change the tiny models' images clearly but stay out of the
# chaotic range where float rounding alone flips pixels (tiny-sdxl is touchier).
# name -> (rank, alpha, target modules); ranks 4, 8 and 16 over different layer subsets.
FLUX_ADAPTERS = {
    "r4-attn": (4, 8.0, ("to_q", "to_k", "to_v", "to_out.0")),
    "r8-context": (8, 8.0, ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_out.0")),
    "r16-mlp": (16, 16.0, ("ff.net.0.proj", "ff.net.2", "proj_mlp", "to_v")),
}
SDXL_ADAPTERS = {
    "r4-attn": (4, 8.0, ("to_q", "to_k", "to_v", "to_out.0")),
    "r16-ff": (16, 8.0, ("ff.net.0.proj", "ff.net.2", "to_q")),
}


def decode(data: bytes) -> np.ndarray:
    """Image file bytes -> HxWx3 int array."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int32)


def assert_images_close(actual: np.ndarray, expected: np.ndarray) -> None:
    diff = np.abs(actual - expected)
    assert actual.shape == expected.shape
    assert diff.max() <= MAX_PIXEL_DIFF and diff.mean() <= MEAN_PIXEL_DIFF, (
        f"images differ: max {diff.max()}, mean {diff.mean():.3f}"
    )


def write_adapters(model: str, directory: Path, specs: dict, init_std: float) -> Path:
    from loraswap.engine.adapters.random_adapter import write_random_adapter
    from loraswap.engine.models import build_builtin_pipeline

    pipe = build_builtin_pipeline(model)
    for index, (name, (rank, alpha, targets)) in enumerate(specs.items()):
        write_random_adapter(
            pipe, directory / name, rank=rank, alpha=alpha, target_modules=targets, seed=index + 1, init_std=init_std
        )
    return directory


@pytest.fixture(scope="session")
def flux_adapter_dir(tmp_path_factory) -> Path:
    return write_adapters("tiny-flux", tmp_path_factory.mktemp("flux-adapters"), FLUX_ADAPTERS, init_std=0.5)


@pytest.fixture(scope="session")
def sdxl_adapter_dir(tmp_path_factory) -> Path:
    return write_adapters("tiny-sdxl", tmp_path_factory.mktemp("sdxl-adapters"), SDXL_ADAPTERS, init_std=0.2)


@pytest.fixture(scope="session")
def exported_models(tmp_path_factory) -> dict[str, Path]:
    """The built-in models as plain diffusers folders, for references made with diffusers alone."""
    from loraswap.engine.models import export_builtin_model

    root = tmp_path_factory.mktemp("models")
    return {name: export_builtin_model(name, root / name) for name in ("tiny-flux", "tiny-sdxl")}


class DiffusersReference:
    """Images from a freshly loaded plain-diffusers pipeline with the adapter loaded the standard way."""

    def __init__(self, model_dir: Path, family: str, adapter_dir: Path) -> None:
        self.model_dir = model_dir
        self.family = family
        self.adapter_dir = adapter_dir
        self._cache: dict[tuple, np.ndarray] = {}

    def image(self, adapter: str, scale: float, *, prompt: str, seed: int, steps: int, guidance: float,
              width: int = 64, height: int = 64) -> np.ndarray:  # fmt: skip
        key = (adapter, scale, prompt, seed, steps, guidance, width, height)
        if key not in self._cache:
            from diffusers import DiffusionPipeline

            pipe = DiffusionPipeline.from_pretrained(self.model_dir)
            pipe.set_progress_bar_config(disable=True)
            kwargs = {}
            if adapter:
                pipe.load_lora_weights(str(self.adapter_dir / adapter))
                attention_kwargs = {"scale": scale}
                kwargs = (
                    {"joint_attention_kwargs": attention_kwargs}
                    if self.family == "flux"
                    else {"cross_attention_kwargs": attention_kwargs}
                )
            if self.family == "flux":
                kwargs["max_sequence_length"] = 32
            result = pipe(
                prompt=prompt, num_inference_steps=steps, guidance_scale=guidance, width=width, height=height,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", **kwargs,
            )  # fmt: skip
            self._cache[key] = np.asarray(result.images[0].convert("RGB")).astype(np.int32)
        return self._cache[key]


@pytest.fixture(scope="session")
def flux_reference(exported_models, flux_adapter_dir) -> DiffusersReference:
    return DiffusersReference(exported_models["tiny-flux"], "flux", flux_adapter_dir)


@pytest.fixture(scope="session")
def sdxl_reference(exported_models, sdxl_adapter_dir) -> DiffusersReference:
    return DiffusersReference(exported_models["tiny-sdxl"], "sdxl", sdxl_adapter_dir)
