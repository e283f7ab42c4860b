"""Concurrent Generate calls all complete, each with its own correct image."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.images import assert_images_close, decode

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUESTS = [("r4-attn", 1.0, 1), ("", 1.0, 2), ("r16-mlp", 0.8, 3), ("r8-context", 1.0, 4), ("r4-attn", 0.5, 5)]


async def test_concurrent_generates_each_get_their_own_image(flux_client, flux_reference):
    info = await flux_client.server_info()

    async def one(adapter, scale, seed):
        return await flux_client.generate_image(
            "a harbour", adapter=adapter, adapter_scale=scale, seed=seed, num_inference_steps=3
        )

    images = await asyncio.gather(*(one(*request) for request in REQUESTS))
    for (adapter, scale, seed), image in zip(REQUESTS, images):
        assert (image.adapter, image.seed) == (adapter, seed)
        expected = flux_reference.image(
            adapter, scale, prompt="a harbour", seed=seed, steps=3, guidance=info.default_guidance_scale
        )
        assert_images_close(decode(image.data), expected)
    assert (await flux_client.server_info()).recompilations == 0


async def test_waiting_requests_see_their_queue_position(flux_client):
    from loraswap.client import Queued

    async def positions(seed):
        return [
            event.position
            async for event in flux_client.generate("a field", seed=seed, num_inference_steps=20)
            if isinstance(event, Queued)
        ]

    results = await asyncio.gather(*(positions(seed) for seed in range(4)))
    assert all(result for result in results)  # everyone hears where they stand
    last = max(results, key=lambda result: result[0])
    assert last[0] >= 2 and last == sorted(last, reverse=True) and last[-1] == 1
