"""In-place adapter swaps: every image equals fresh diffusers' with that adapter; nothing recompiles."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.images import MIN_ADAPTER_EFFECT, assert_images_close, decode
from tests.support.slots import gates_match_resident

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a lighthouse at dusk"
SEED = 11
STEPS = 4

# Ranks 4, 8, 16 over different layer subsets, strengths, and the base model in between.
FLUX_SEQUENCE = [
    ("", None),
    ("r4-attn", None),
    ("r16-mlp", None),
    ("r8-context", 0.6),
    ("", None),
    ("r16-mlp", -0.5),
    ("r4-attn", 1.5),
    ("r8-context", 0.6),
    ("r4-attn", None),
    ("", None),
]
SDXL_SEQUENCE = [("", None), ("r4-attn", None), ("r16-ff", 0.7), ("", None), ("r16-ff", None), ("r4-attn", 0.5)]


async def run_sequence(client, reference, sequence, guidance):
    images = {}
    for adapter, scale in sequence:
        image = await client.generate_image(
            PROMPT, adapter=adapter, adapter_scale=scale, seed=SEED, num_inference_steps=STEPS
        )
        assert image.adapter == adapter
        expected = reference.image(
            adapter, 1.0 if scale is None else scale, prompt=PROMPT, seed=SEED, steps=STEPS, guidance=guidance
        )
        actual = decode(image.data)
        assert_images_close(actual, expected)
        images[(adapter, scale)] = actual
    return images


# After warm-up, no size from min_size up and no guidance setting compiles a new graph. The SDXL sizes
# include those that used to (float32 convolutions guarding on C*H*W at batch 1, i.e. guidance off).
SDXL_SIZES = [(8, 8), (48, 48), (72, 72), (88, 88), (104, 104), (144, 144), (8, 136), (200, 48), (120, 72)]
FLUX_SIZES = [(8, 8), (8, 12), (12, 8), (60, 60), (100, 36), (132, 124), (256, 64)]


async def assert_no_compile_at_any_size(client, sizes):
    info = await client.server_info()
    assert min(min(size) for size in sizes) == info.min_size
    before = info.recompilations
    for width, height in sizes:
        for guidance in (None, 1.0):
            image = await client.generate_image(
                PROMPT, seed=SEED, num_inference_steps=1, width=width, height=height, guidance_scale=guidance
            )
            assert (image.width, image.height) == (width, height)
    assert (await client.server_info()).recompilations == before == 0


async def test_no_sdxl_size_or_guidance_compiles_after_warm_up(sdxl_client):
    await assert_no_compile_at_any_size(sdxl_client, SDXL_SIZES)


async def test_no_flux_size_or_guidance_compiles_after_warm_up(flux_client):
    await assert_no_compile_at_any_size(flux_client, FLUX_SIZES)


def assert_all_distinct(images):
    keys = list(images)
    for i, first in enumerate(keys):
        for second in keys[i + 1 :]:
            effect = np.abs(images[first] - images[second]).max()
            assert effect >= MIN_ADAPTER_EFFECT, f"{first} and {second} look alike (max diff {effect})"


async def test_flux_swaps_match_fresh_diffusers_without_recompiling(flux_client, flux_reference, flux_server):
    info = await flux_client.server_info()
    assert info.compiled and info.family == "flux"
    before = info.recompilations
    images = await run_sequence(flux_client, flux_reference, FLUX_SEQUENCE, info.default_guidance_scale)
    assert_all_distinct(images)
    after = await flux_client.server_info()
    assert before == 0 and after.recompilations == 0
    # The slot's invariant after every swap: each gate opens exactly the resident ranks; every weight is finite.
    assert gates_match_resident(flux_server.engine.runtime.residency.slot)


async def test_sdxl_swaps_match_fresh_diffusers_without_recompiling(sdxl_client, sdxl_reference):
    info = await sdxl_client.server_info()
    assert info.compiled and info.family == "sdxl"
    images = await run_sequence(sdxl_client, sdxl_reference, SDXL_SEQUENCE, info.default_guidance_scale)
    assert_all_distinct(images)
    assert (await sdxl_client.server_info()).recompilations == 0


async def test_base_model_after_adapters_equals_base_before(flux_client):
    before = await flux_client.generate_image(PROMPT, seed=5)
    for adapter in ("r4-attn", "r16-mlp", "r8-context"):
        await flux_client.generate_image(PROMPT, adapter=adapter, seed=5)
    after = await flux_client.generate_image(PROMPT, seed=5)
    assert before.data == after.data
    assert after.timings.adapter_swap_ms > 0  # it really swapped back


async def test_resident_adapter_is_reported(flux_client):
    await flux_client.generate_image(PROMPT, adapter="r16-mlp", seed=1)
    info = await flux_client.server_info()
    assert info.resident_adapter == "r16-mlp"
    listed = {adapter.id: adapter for adapter in (await flux_client.list_adapters()).adapters}
    assert listed["r16-mlp"].resident and listed["r16-mlp"].rank == 16
    assert not listed["r4-attn"].resident


async def test_same_adapter_and_scale_does_not_swap_again(flux_client):
    await flux_client.generate_image(PROMPT, adapter="r4-attn", adapter_scale=0.9, seed=1)
    again = await flux_client.generate_image(PROMPT, adapter="r4-attn", adapter_scale=0.9, seed=2)
    assert again.timings.adapter_swap_ms == 0.0
