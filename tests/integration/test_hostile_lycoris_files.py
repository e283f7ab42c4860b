"""Hostile LyCORIS and kohya files against one real tiny-sdxl server (float32, --fuse auto): what the hostile-file
probe found, each refused where the file first becomes known, with its own reason and what to do, while the server
keeps serving and the resident model and the cached adapters stay as they were.

The files are the LyCORIS package's own (tests/support/lycoris_files.py), edited: a layer carrying two kinds'
tensors, factors of 1e20 (a LoHa merge about 1e81, a LoRA's and a LoKr's 1e40), a float64 LoHa of 1e300, an alpha of
-1e30 on every layer, and a LoHa that fits at strength 1 but not at 8. A valid LoHa is served before and after each
case as the control.
"""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

from loraswap.client import LoraswapError
from tests.support.lycoris_files import KINDS, TEST_PRESET, write_lycoris_file
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUEST = dict(prompt="a lighthouse at dusk", seed=3, num_inference_steps=2, guidance_scale=5.0)
CONTROL = "loha"
# The range a float32 model serves a change in: √ of float32's largest value (adapters/formats/change_effects.py).
FLOAT32_RANGE = math.sqrt(torch.finfo(torch.float32).max)
NEAR_RANGE_FIT = 3.2  # the near-range LoHa moves its strongest layer to FLOAT32_RANGE / 3.2 at strength 1
ATTENTION_PRESET = dict(TEST_PRESET, unet_target_module=["Transformer2DModel"], unet_target_name=[])


def _layers_with(tensors: dict, tensor: str) -> list[str]:
    return sorted(key.removesuffix("." + tensor) for key in tensors if key.endswith("." + tensor))


def _loha_effect(tensors: dict, layer: str) -> float:
    """max|ΔW| of one LoHa layer at strength 1, formed in float64 as LyCORIS defines it."""
    w1a, w1b, w2a, w2b = (tensors[f"{layer}.hada_{name}"].double() for name in ("w1_a", "w1_b", "w2_a", "w2_b"))
    rank = w1b.shape[0]
    alpha = float(tensors[f"{layer}.alpha"]) if f"{layer}.alpha" in tensors else rank
    delta = (w1a.reshape(w1a.shape[0], -1) @ w1b.reshape(rank, -1)) * (
        w2a.reshape(w2a.shape[0], -1) @ w2b.reshape(rank, -1)
    )
    return float(delta.abs().max()) * abs(alpha / rank)


def _write_hostile_files(root: Path) -> None:
    write_lycoris_file(root / "loha.safetensors", KINDS["loha"], seed=1)
    write_lycoris_file(root / "lokr.safetensors", KINDS["lokr"], seed=2)
    write_lycoris_file(root / "lora.safetensors", dict(algo="lora"), seed=3, preset=ATTENTION_PRESET)
    loha, lokr, lora = (load_file(root / f"{name}.safetensors") for name in ("loha", "lokr", "lora"))

    def edited(source: dict, name: str, edit) -> None:
        tensors = {key: value.clone() for key, value in source.items()}
        edit(tensors)
        save_file(tensors, root / f"{name}.safetensors")

    unet_loha = next(layer for layer in _layers_with(loha, "hada_w1_a") if layer.startswith("lora_unet_"))

    def with_lora_keys(tensors: dict) -> None:
        out_features, in_features = (
            tensors[f"{unet_loha}.hada_w1_a"].shape[0],
            tensors[f"{unet_loha}.hada_w1_b"].shape[1],
        )
        tensors[f"{unet_loha}.lora_up.weight"] = torch.full((out_features, 2), 0.01)
        tensors[f"{unet_loha}.lora_down.weight"] = torch.full((2, in_features), 0.01)

    def with_lokr_keys(tensors: dict) -> None:
        tensors[f"{unet_loha}.lokr_w1"] = torch.ones(1, 1)
        tensors[f"{unet_loha}.lokr_w2"] = torch.full((tensors[f"{unet_loha}.hada_w1_a"].shape[0], 1), 0.01)

    def every(prefix: str, value: float, dtype=None):
        def edit(tensors: dict) -> None:
            for key in [key for key in tensors if key.rsplit(".", 1)[-1].startswith(prefix) or f".{prefix}" in key]:
                tensors[key] = torch.full_like(tensors[key], value, dtype=dtype or tensors[key].dtype)

        return edit

    def alphas(value: float):
        def edit(tensors: dict) -> None:
            for key in [key for key in tensors if key.endswith(".alpha")]:
                tensors[key] = torch.full_like(tensors[key], value)

        return edit

    def near_range(tensors: dict) -> None:
        # Every layer's alpha times one factor, so that the strongest layer moves FLOAT32_RANGE / NEAR_RANGE_FIT.
        strongest = max(_loha_effect(tensors, layer) for layer in _layers_with(tensors, "hada_w1_a"))
        factor = FLOAT32_RANGE / NEAR_RANGE_FIT / strongest
        for key in [key for key in tensors if key.endswith(".alpha")]:
            tensors[key] = tensors[key].double() * factor

    edited(loha, "loha-and-lora-keys", with_lora_keys)
    edited(loha, "loha-and-lokr-keys", with_lokr_keys)
    edited(loha, "loha-1e20", every("hada_", 1e20))
    edited(loha, "loha-float64-1e300", every("hada_", 1e300, torch.float64))
    edited(lora, "lora-1e20", every("lora_", 1e20))
    edited(lokr, "lokr-1e20", every("lokr_", 1e20))
    edited(loha, "loha-alpha-minus-1e30", alphas(-1e30))
    edited(loha, "loha-near-range", near_range)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tmp_path_factory):
    """The server of the hostile files, written into a folder of the module's own."""
    hostile_dir = tmp_path_factory.mktemp("hostile-lycoris")
    _write_hostile_files(hostile_dir)
    # Uncompiled: what is checked here is where each file is refused and what stays as it was; the compiled
    # servers of test_lycoris_adapters.py and test_hostile_inputs.py hold that refusals compile nothing.
    async with serving("tiny-sdxl", hostile_dir, fuse="auto", compile=False) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def before(server) -> dict:
    """The base model's and the control's images and the cached adapters, before any case ran."""
    async with client_of(server) as client:
        base = (await client.generate_image(**REQUEST)).data
        control = (await client.generate_image(**REQUEST, adapter=CONTROL)).data
        assert base != control
        return {"base": base, "control": control, "cached": await _cached(client)}


async def _cached(client) -> set[str]:
    return {adapter.id for adapter in (await client.list_adapters()).adapters}


async def _unchanged(client, before: dict) -> None:
    """The server serves on, the control adapter as before (merged from the same pristine weights as every image),
    the cache as before. The base model's own image is compared at the end."""
    assert await _cached(client) == before["cached"]
    assert (await client.generate_image(**REQUEST, adapter=CONTROL)).data == before["control"]


async def _refusal(client, how: str, name: str, scale: float = 1.0) -> LoraswapError:
    with pytest.raises(LoraswapError) as caught:
        if how == "preload":
            await client.preload_adapter(name)
        else:
            await client.generate_image(**REQUEST, adapter=name, adapter_scale=scale)
    return caught.value


@pytest.mark.parametrize(
    ("how", "name", "kinds"),
    [("preload", "loha-and-lora-keys", "LoHa,LoRA"), ("generate", "loha-and-lokr-keys", "LoHa,LoKr")],
)
async def test_a_layer_with_two_kinds_is_refused_not_cut_down(client, before, how, name, kinds) -> None:
    error = await _refusal(client, how, name)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_MIXED_KINDS"), error
    assert error.metadata["kinds"] == kinds and error.metadata["layer"] in error.message
    await _unchanged(client, before)


# Each file by one way in (a Generate's cold load or PreloadAdapter), both ways covered.
@pytest.mark.parametrize(
    ("how", "name", "fits"),
    [("generate", "loha-1e20", False), ("preload", "loha-float64-1e300", False), ("generate", "lora-1e20", True),
     ("preload", "lokr-1e20", False), ("generate", "loha-alpha-minus-1e30", True),
     ("preload", "loha-alpha-minus-1e30", True)],
)  # fmt: skip
async def test_an_adapter_past_the_range_at_strength_1_is_refused_where_it_loads_and_never_cached(
    client, before, how, name, fits
) -> None:
    error = await _refusal(client, how, name)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_OUT_OF_RANGE"), error
    assert "at strength 1" in error.message and error.metadata["layer"] in error.message
    if fits:  # the strength that would fit is named, and why it does not help
        assert 0 < float(error.metadata["max_scale"]) < 1 and "must fit at strength 1" in error.message
    else:  # a 1e81 or 1e300-squared change: no strength a request can send fits
        assert "max_scale" not in error.metadata and "no strength" in error.message
    assert "lower adapter_scale" not in error.message
    await _unchanged(client, before)


async def test_a_strength_past_the_range_is_refused_and_the_adapter_serves_at_others(client, before) -> None:
    preloaded = await client.preload_adapter("loha-near-range")
    assert preloaded.adapter.id == "loha-near-range"
    cached = await _cached(client)
    error = await _refusal(client, "generate", "loha-near-range", scale=8.0)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_OUT_OF_RANGE"), error
    fit = float(error.metadata["max_scale"])
    assert (
        NEAR_RANGE_FIT * 0.99 <= fit <= NEAR_RANGE_FIT
        and f"strengths up to {error.metadata['max_scale']}" in error.message
    )
    assert error.metadata["field"] == "adapter_scale" and "stays cached" in error.message
    assert await _cached(client) == cached  # refused for the strength only: still cached, still valid
    image = await client.generate_image(**REQUEST, adapter="loha-near-range", adapter_scale=1e-20)
    assert image.data and image.fused
    await client.evict("loha-near-range")
    await _unchanged(client, before)


async def test_the_control_and_a_real_lycoris_file_are_served_as_before(client, before) -> None:
    for name in ("lokr", "lora"):
        assert (await client.generate_image(**REQUEST, adapter=name)).data != before["base"]
    await _unchanged(client, before | {"cached": await _cached(client)})
    assert (await client.generate_image(**REQUEST)).data == before["base"]
