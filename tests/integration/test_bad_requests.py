"""Bad requests get a clear status and reason; the server keeps serving and the model is unchanged."""

from __future__ import annotations

import grpc
import pytest

from loraswap.client import LoraswapError

pytestmark = pytest.mark.asyncio(loop_scope="session")

BAD_GENERATES = [
    (dict(adapter="no-such-adapter"), grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", "no-such-adapter"),
    (dict(adapter="../outside"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", ".."),
    (dict(adapter="/etc/passwd"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "absolute"),
    (dict(num_inference_steps=0), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "num_inference_steps"),
    (dict(num_inference_steps=100000), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "1 to 200"),
    (dict(width=66), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "multiple of 4"),
    (dict(height=0), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "height"),
    # One packed token: below GetServerInfo.min_size (8 on tiny-flux), so refused rather than compiled.
    (dict(width=4, height=4), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "between 8 and"),
    (dict(width=100000), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "width"),
    (dict(guidance_scale=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "guidance_scale"),
    (dict(adapter="r4-attn", adapter_scale=100.0), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "adapter_scale"),
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "prompt"),
]


@pytest.mark.parametrize(("overrides", "code", "reason", "hint"), BAD_GENERATES)
async def test_bad_generate_is_refused_and_nothing_changes(flux_client, overrides, code, reason, hint):
    request = dict(prompt="a boat", seed=4, adapter="r4-attn", num_inference_steps=2)
    before = await flux_client.generate_image(**request)
    with pytest.raises(LoraswapError) as caught:
        await flux_client.generate_image(**{**request, **overrides})
    error = caught.value
    assert (error.code, error.reason) == (code, reason)
    assert hint in error.message
    after = await flux_client.generate_image(**request)
    assert after.data == before.data
    assert (await flux_client.server_info()).recompilations == 0


@pytest.mark.parametrize(
    ("call", "code", "reason"),
    [
        ("preload_adapter", grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND"),
        ("evict", grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND"),
    ],
)
async def test_unknown_adapter_in_unary_calls(flux_client, call, code, reason):
    with pytest.raises(LoraswapError) as caught:
        await getattr(flux_client, call)("never-heard-of-it")
    assert (caught.value.code, caught.value.reason) == (code, reason)


async def test_preload_then_evict(flux_client):
    first = await flux_client.preload_adapter("r8-context")
    again = await flux_client.preload_adapter("r8-context")
    assert again.already_cached and again.adapter.rank == 8
    assert set(first.adapter.target_layers) == set(again.adapter.target_layers)
    freed = await flux_client.evict("r8-context")
    assert freed == again.adapter.size_bytes > 0
    assert "r8-context" not in {adapter.id for adapter in (await flux_client.list_adapters()).adapters}
    reloaded = await flux_client.preload_adapter("r8-context")
    assert not reloaded.already_cached
