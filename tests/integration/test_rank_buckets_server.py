"""A server with rank buckets: images equal plain diffusers' in every bucket, and moving between buckets compiles nothing."""

from __future__ import annotations

import pytest

from tests.support.images import assert_images_close, decode
from tests.support.servers import client_of, server_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a lighthouse at dusk"
SEED = 11
STEPS = 4  # the prompt, seed and steps of the other swap tests: their references are made once
BUCKETS = (8, 16)

# Single adapters of ranks 2 and 4 (bucket 8) and 16 (bucket 16), stacks summing to 6 and 14 on their fullest
# layer (buckets 8 and 16), and the base model (no LoRA branch), moving up and down the buckets.
SEQUENCE = [
    [("r4-attn", 1.0)],
    [("r16-mlp", 0.7)],
    [],
    [("r4-attn", 0.8), ("r2-single", 1.0)],
    [("r4-attn", 1.0), ("r8-context", 0.6), ("r2-ff-context", -1.0)],
    [("r2-ff-context", 1.0)],
    [],
]


async def test_images_equal_diffusers_in_every_bucket_and_nothing_recompiles(flux_adapter_dir, flux_reference):
    # eager: dynamo's tracing and guards, which decide recompilation, without compiling the graphs further.
    # --fuse never: every bucket graph is compiled and used (auto compiles only those its rule can choose).
    settings = server_settings(
        "tiny-flux", flux_adapter_dir, rank_buckets=BUCKETS[:-1], compile_backend="eager", fuse="never"
    )
    async with serving(settings) as running, client_of(running) as client:
        info = await client.server_info()
        assert info.rank_buckets == BUCKETS  # the max rank appended
        assert info.compiled and info.recompilations == 0
        residency = running.engine.runtime.residency
        buckets_seen = set()
        for members in SEQUENCE:
            image = await client.generate_image(PROMPT, adapters=members, seed=SEED, num_inference_steps=STEPS)
            buckets_seen.add(residency.bucket)
            expected = flux_reference.stack_image(
                members, prompt=PROMPT, seed=SEED, steps=STEPS, guidance=info.default_guidance_scale
            )
            assert_images_close(decode(image.data), expected)
        assert buckets_seen == {0, *BUCKETS}
        assert (await client.server_info()).recompilations == 0
