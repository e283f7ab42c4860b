"""The default torch.compile backend (inductor) through a real server: swaps, references, no recompiles."""

from __future__ import annotations

import pytest

from tests.support.images import assert_images_close, decode
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

STACK_OF_TWO = [("r4-attn", 0.8), ("r8-context", 1.0)]
STACK_OF_FOUR = [("r4-attn", 1.0), ("r8-context", 0.6), ("r2-ff-context", -1.0), ("r2-single", 1.5)]


async def test_inductor_swaps_match_diffusers_without_recompiling(flux_adapter_dir, flux_reference):
    async with (
        serving("tiny-flux", flux_adapter_dir, compile_backend="inductor") as running,
        client_of(running, default_timeout=300) as client,
    ):
        info = await client.server_info()
        assert info.compiled
        for adapter, scale in [("r4-attn", 1.0), ("", 1.0), ("r16-mlp", 0.7), ("r8-context", 1.0), ("", 1.0)]:
            image = await client.generate_image(
                "a lighthouse at dusk", adapter=adapter, adapter_scale=scale, seed=11, num_inference_steps=4
            )
            expected = flux_reference.image(
                adapter, scale, prompt="a lighthouse at dusk", seed=11, steps=4,
                guidance=info.default_guidance_scale,
            )  # fmt: skip
            assert_images_close(decode(image.data), expected)
        # Stacks of two and four (other layouts, summed ranks up to the slot's 16) <-> single adapters <-> base.
        for members in [STACK_OF_TWO, [("r16-mlp", 0.7)], STACK_OF_FOUR, [("r8-context", 1.0)], STACK_OF_TWO, []]:
            image = await client.generate_image(
                "a lighthouse at dusk", adapters=members, seed=11, num_inference_steps=4
            )
            expected = flux_reference.stack_image(
                members, prompt="a lighthouse at dusk", seed=11, steps=4, guidance=info.default_guidance_scale
            )
            assert_images_close(decode(image.data), expected)
        assert (await client.server_info()).recompilations == 0
