"""Several adapters in one request: stacked side by side in the slot, equal to diffusers' multi-adapter result.

Every test here runs on one fresh, compiled tiny-flux server of its own (max rank 16), whose single-adapter
and base-model images are taken before it ever holds a stack: after any stack, those must come back bit for bit.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import pytest_asyncio

from loraswap.client import AsyncLoraswapClient, LoraswapError, StackedAdapter
from tests.support.images import MIN_ADAPTER_EFFECT, assert_images_close, decode
from tests.support.servers import client_of, serving
from tests.support.slots import gates_match_resident

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a lighthouse at dusk"
SEED = 11
STEPS = 4

# Two members sharing one layer (to_out.0: 4 + 8) and changing others alone, at different ranks and strengths.
TWO = [("r4-attn", 0.8), ("r8-context", 1.0)]
# Four members that fill the rank-16 slot exactly on to_out.0 (4 + 8 + 2 + 2), share to_q (4 + 2) and change
# other layers alone; one at a negative strength.
FOUR = [("r4-attn", 1.0), ("r8-context", 0.6), ("r2-ff-context", -1.0), ("r2-single", 1.5)]
# Two members with no layer in common, one at the slot's full rank.
APART = [("r16-mlp", 0.7), ("r2-ff-context", 1.0)]
STACKS = {"two": TWO, "four": FOUR, "apart": APART}
SINGLES = [("r8-context", 0.6), ("r16-mlp", 1.0), ("", None)]


async def image_of(client: AsyncLoraswapClient, adapters=(), **single):
    return await client.generate_image(PROMPT, adapters=adapters, seed=SEED, num_inference_steps=STEPS, **single)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack_server(flux_adapter_dir):
    """A fresh server, and its single-adapter and base images from before it held any stack."""
    # --fuse never: stacks in the slot, and its STACK_RANK_EXCEEDED (fused stacks: test_fused_adapters).
    async with serving("tiny-flux", flux_adapter_dir, fuse="never") as running:
        async with client_of(running) as client:
            fresh = {
                (adapter, scale): await image_of(client, adapter=adapter, adapter_scale=scale)
                for adapter, scale in SINGLES
            }
        yield running, fresh


@pytest_asyncio.fixture(loop_scope="session")
async def client(stack_server):
    async with client_of(stack_server[0]) as client:
        yield client


@pytest.mark.parametrize("members", list(STACKS.values()), ids=list(STACKS))
async def test_a_stack_matches_diffusers_with_the_adapters_set_together(client, flux_reference, members):
    info = await client.server_info()
    image = await image_of(client, members)
    expected = flux_reference.stack_image(
        members, prompt=PROMPT, seed=SEED, steps=STEPS, guidance=info.default_guidance_scale
    )
    actual = decode(image.data)
    assert_images_close(actual, expected)
    assert image.adapters == tuple(StackedAdapter(name, scale) for name, scale in members)
    assert (image.adapter, image.adapter_scale) == ("", 1.0)
    # Every member counts: the stack looks like none of its members alone.
    for name, scale in members:
        alone = decode((await image_of(client, adapter=name, adapter_scale=scale)).data)
        assert np.abs(actual - alone).max() >= MIN_ADAPTER_EFFECT, f"the stack looks like {name} alone"
    assert (await client.server_info()).recompilations == 0


async def test_the_order_of_members_changes_nothing_and_needs_no_swap(client, stack_server):
    engine = stack_server[0].engine
    first = await image_of(client, FOUR)
    swaps = engine.swaps
    for reordered in (FOUR[::-1], [FOUR[2], FOUR[0], FOUR[3], FOUR[1]]):
        again = await image_of(client, reordered)
        # Members go into the slot in one fixed order, so the image is the same bit for bit.
        assert again.data == first.data
        assert again.timings.adapter_swap_ms == 0.0
        assert again.adapters == tuple(StackedAdapter(name, scale) for name, scale in reordered)
    assert engine.swaps == swaps
    # The same members at another strength do swap.
    stronger = await image_of(client, [(name, 1.0) for name, _ in FOUR])
    assert stronger.timings.adapter_swap_ms > 0 and stronger.data != first.data


async def test_a_stack_of_one_is_the_single_adapter(client):
    single = await image_of(client, adapter="r8-context", adapter_scale=0.6)
    stacked = await image_of(client, [("r8-context", 0.6)])
    assert stacked.data == single.data
    assert stacked.timings.adapter_swap_ms == 0.0  # the same resident state
    assert (stacked.adapter, stacked.adapter_scale) == ("r8-context", 0.6)
    assert stacked.adapters == single.adapters == (StackedAdapter("r8-context", 0.6),)


@pytest.mark.parametrize("members", [TWO, FOUR], ids=["two", "four"])
async def test_single_adapters_and_the_base_after_a_stack_equal_a_fresh_server(client, stack_server, members):
    fresh = stack_server[1]
    for adapter, scale in SINGLES:
        await image_of(client, members)
        after = await image_of(client, adapter=adapter, adapter_scale=scale)
        assert after.timings.adapter_swap_ms > 0  # it really swapped away from the stack
        assert after.data == fresh[(adapter, scale)].data, (adapter, scale)
    assert gates_match_resident(stack_server[0].engine.runtime.residency.slot)
    assert (await client.server_info()).recompilations == 0


async def test_the_resident_stack_is_reported(client):
    await image_of(client, TWO)
    info = await client.server_info()
    assert info.resident_adapters == ("r4-attn", "r8-context") and info.resident_adapter == ""
    assert info.max_stack == 4
    resident = {adapter.id for adapter in (await client.list_adapters()).adapters if adapter.resident}
    assert resident == {"r4-attn", "r8-context"}
    await image_of(client, adapter="r4-attn")
    info = await client.server_info()
    assert (info.resident_adapter, info.resident_adapters) == ("r4-attn", ("r4-attn",))


# request fields, status, reason, and a piece of the message
REFUSED = [
    (dict(adapters=[("r16-mlp", 1.0), ("r4-attn", 1.0)]), grpc.StatusCode.FAILED_PRECONDITION, "STACK_RANK_EXCEEDED",
     "add up to 20 on layer single_transformer_blocks.0.attn.to_v, above the server's max rank 16"),
    (dict(adapters=[("r4-attn", 1.0), ("r4-attn", 0.5)]), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST",
     "'r4-attn' appears twice"),
    (dict(adapters=[("r4-attn", 1.0), ("r4-attn/pytorch_lora_weights", 0.5)]), grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_REQUEST", "are the same file"),
    (dict(adapter="r4-attn", adapters=[("r8-context", 1.0)]), grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_MISMATCH",
     "both adapter and adapters"),
    (dict(adapter_scale=0.5, adapters=[("r8-context", 1.0)]), grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_MISMATCH",
     "both adapter_scale and adapters"),
    (dict(adapters=["r4-attn", "r8-context", "r2-single", "r2-ff-context", "r16-mlp"]),
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "stacks at most 4 (--max-stack)"),
    (dict(adapters=[("r4-attn", 1.0), ("no-such-adapter", 1.0)]), grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND",
     "no-such-adapter"),
    (dict(adapters=[("r4-attn", 1.0), ("r8-context", 9.0)]), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST",
     "adapters[1].scale is 9.0"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("request_fields", "code", "reason", "hint"),
    REFUSED,
    ids=["rank", "duplicate", "same-file", "both-fields", "scale-and-stack", "too-many", "unknown", "strength"],
)
async def test_a_refused_stack_leaves_the_resident_stack_unchanged(client, request_fields, code, reason, hint):
    before = await image_of(client, TWO)
    with pytest.raises(LoraswapError) as caught:
        await client.generate_image(PROMPT, seed=SEED, num_inference_steps=STEPS, **request_fields)
    assert (caught.value.code, caught.value.reason) == (code, reason)
    assert hint in caught.value.message
    if reason == "STACK_RANK_EXCEEDED":
        assert caught.value.metadata == {
            "layer": "single_transformer_blocks.0.attn.to_v", "rank": "20", "max_rank": "16"
        }  # fmt: skip
    after = await image_of(client, TWO)
    assert after.timings.adapter_swap_ms == 0.0 and after.data == before.data
    info = await client.server_info()
    assert info.resident_adapters == ("r4-attn", "r8-context") and info.recompilations == 0
