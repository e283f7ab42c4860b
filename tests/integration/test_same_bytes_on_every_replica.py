"""Same request, same bytes on every replica: two servers started one after the other with the default flags on a
bfloat16 tiny model, one first given another history, return identical bytes for every request of a common list.

In bfloat16 fused and unfused images of one adapter differ in most pixels, so any choice between the two that
depended on timings, the queue or what ran before would show here. Also: the same file under two names gives the
same bytes, before and after it is evicted and read again; a cached file rewritten in place or replaced by a
rename is served as the old file until evicted, then as the new one, each bit-identical to a fresh server's image
of that file; and the pinned path (GenerateRequest.fuse) is honoured, or refused with FUSE_CHOICE_UNAVAILABLE
where the server cannot take it, changing nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import pytest_asyncio

from loraswap.client import LoraswapError
from loraswap.server.config import Settings
from loraswap.server.engine.config import DEFAULT_MAX_RANK, EngineConfig
from tests.support.adapters import write_random_adapters
from tests.support.servers import TEST_TORCH_THREADS, client_of, serving

MODEL = "tiny-sdxl"
PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
ADAPTERS = {
    "ink": dict(rank=4, alpha=8.0, target_modules=PROJECTIONS, seed=1),
    "paper": dict(rank=8, alpha=8.0, target_modules=PROJECTIONS, seed=2),
    "grain": dict(rank=16, alpha=16.0, target_modules=("to_q", "to_v"), seed=3),
    # Over the default max rank: only a fused swap can apply it.
    "wide": dict(rank=DEFAULT_MAX_RANK + 16, alpha=32.0, target_modules=("to_q", "to_out.0"), seed=4),
}
PROMPT = "a red square on a green field"

# (name, request keywords): what both servers are asked, in this order.
COMMON = [
    ("ink-1", dict(adapter="ink", num_inference_steps=1)),
    ("ink-3", dict(adapter="ink", num_inference_steps=3)),
    ("paper-0.7", dict(adapter="paper", adapter_scale=0.7, num_inference_steps=2)),
    ("paper-3", dict(adapter="paper", num_inference_steps=3)),
    ("stack", dict(adapters=[("ink", 1.0), ("paper", 0.5)], num_inference_steps=3)),
    ("wide", dict(adapter="wide", num_inference_steps=2)),
    ("base", dict(num_inference_steps=2)),
    ("ink-unfused", dict(adapter="ink", num_inference_steps=3, fuse="unfused")),
    ("ink-fused", dict(adapter="ink", num_inference_steps=3, fuse="fused")),
    ("ink-copy-3", dict(adapter="ink-copy", num_inference_steps=3)),
    ("ink-copy-1", dict(adapter="ink-copy", num_inference_steps=1)),
]


def _settings(adapter_dir, **engine) -> Settings:
    # The defaults `loraswap serve` runs with (no compile on a CPU, --fuse auto, max rank 64), in bfloat16.
    config = EngineConfig(model=MODEL, dtype="bfloat16", adapter_dir=adapter_dir, torch_threads=TEST_TORCH_THREADS,
                          **engine)  # fmt: skip
    return Settings(engine=config, host="127.0.0.1", port=0)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    root = write_random_adapters(MODEL, tmp_path_factory.mktemp("replicas"), ADAPTERS, init_std=0.2)
    shutil.copytree(root / "ink", root / "ink-copy")  # the same file under another name
    for name in ("rewritten", "renamed"):
        shutil.copytree(root / "ink", root / name)
    return root


async def _image(client, **options):
    return await client.generate_image(PROMPT, seed=11, **options)


async def _common(client) -> dict[str, object]:
    return {name: await _image(client, **options) for name, options in COMMON}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def first_replica(adapter_dir):
    """The first server: another history (other adapters, stacks, strengths, the base model, a burst of queued
    requests for one adapter), then the common list."""
    async with serving(_settings(adapter_dir)) as running, client_of(running) as client:
        await _image(client, adapter="grain", adapter_scale=1.5, num_inference_steps=2)
        await _image(client, adapters=[("paper", 0.3), ("grain", 1.0)], num_inference_steps=1)
        await _image(client, num_inference_steps=1)
        await _image(client, adapter="wide", adapter_scale=0.5, num_inference_steps=1)
        # A burst for one adapter, queued behind each other (under the old rule, steps queued behind a request
        # changed its choice).
        await asyncio.gather(*(_image(client, adapter="ink", num_inference_steps=1 + i % 3) for i in range(6)))
        await _image(client, adapter="paper", adapter_scale=-0.4, num_inference_steps=4)
        images = await _common(client)
        yield running, client, images


@pytest.mark.asyncio(loop_scope="session")
async def test_two_servers_started_one_after_the_other_give_identical_bytes(first_replica, adapter_dir) -> None:
    _, _, first = first_replica
    async with serving(_settings(adapter_dir)) as running, client_of(running) as client:
        second = await _common(client)
    for name, _ in COMMON:
        assert first[name].fused == second[name].fused, name
        assert first[name].data == second[name].data, f"{name}: the two servers gave different bytes"
    # Both paths are in the list, and in bfloat16 they differ: a choice that moved would have shown.
    assert first["ink-fused"].fused and not first["ink-unfused"].fused
    assert first["ink-fused"].data != first["ink-unfused"].data
    assert first["wide"].fused and not first["base"].fused


@pytest.mark.asyncio(loop_scope="session")
async def test_the_same_file_under_two_names_gives_the_same_bytes_before_and_after_an_eviction(first_replica) -> None:
    _, client, first = first_replica
    assert first["ink-copy-3"].data == first["ink-3"].data
    assert first["ink-copy-1"].data == first["ink-1"].data
    # A stack whose member is reached by the other name: the same bytes too (members are ordered by content).
    stack = await _image(client, adapters=[("paper", 0.5), ("ink-copy", 1.0)], num_inference_steps=3)
    assert stack.data == first["stack"].data
    assert await client.evict("ink") > 0
    again = await _image(client, adapter="ink", num_inference_steps=3)
    assert again.data == first["ink-3"].data


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("how", ["rewritten", "renamed"])
async def test_a_cached_file_changed_on_disk_is_served_as_the_old_file_then_after_an_eviction_as_the_new(
    first_replica, adapter_dir, how: str
) -> None:
    """`rewritten`: the file written over in place; `renamed`: a new file renamed over it. Until the adapter is
    evicted the cache serves the old file; then the new one, each bit-identical to that file's image elsewhere
    (ink's and paper's, which the second server gave byte for byte)."""
    _, client, first = first_replica
    assert first["ink-3"].data != first["paper-3"].data  # the old file's image and the new one's differ
    old = await _image(client, adapter=how, num_inference_steps=3)
    assert old.data == first["ink-3"].data
    path = adapter_dir / how / "pytorch_lora_weights.safetensors"
    new_bytes = (adapter_dir / "paper" / "pytorch_lora_weights.safetensors").read_bytes()
    if how == "rewritten":
        with path.open("r+b") as handle:
            handle.truncate(0)
            handle.write(new_bytes)
    else:
        staged = path.with_suffix(".staged")
        staged.write_bytes(new_bytes)
        os.replace(staged, path)
    assert (await _image(client, adapter=how, num_inference_steps=3)).data == first["ink-3"].data
    assert await client.evict(how) > 0
    assert (await _image(client, adapter=how, num_inference_steps=3)).data == first["paper-3"].data


@pytest.mark.asyncio(loop_scope="session")
async def test_an_unfused_pin_the_slot_cannot_hold_is_refused_and_changes_nothing(first_replica) -> None:
    _, client, first = first_replica
    for options in (dict(adapter="wide"), dict(adapters=[("wide", 1.0), ("ink", 1.0)])):
        with pytest.raises(LoraswapError) as refused:
            await _image(client, num_inference_steps=2, fuse="unfused", **options)
        assert refused.value.code.name == "FAILED_PRECONDITION" and refused.value.reason == "FUSE_CHOICE_UNAVAILABLE"
        assert "FUSE_CHOICE_UNFUSED" in str(refused.value) and "must_fuse" in str(refused.value)
    assert (await _image(client, adapter="wide", num_inference_steps=2)).data == first["wide"].data


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("engine", [dict(fuse="never"), dict(quantize="int8wo")], ids=["fuse-never", "quantized"])
async def test_a_fused_pin_on_a_server_that_does_not_fuse_is_refused(adapter_dir, engine) -> None:
    async with serving(_settings(adapter_dir, **engine)) as running, client_of(running) as client:
        with pytest.raises(LoraswapError) as refused:
            await _image(client, adapter="ink", num_inference_steps=1, fuse="fused")
        assert refused.value.code.name == "FAILED_PRECONDITION" and refused.value.reason == "FUSE_CHOICE_UNAVAILABLE"
        assert ("--fuse never" if "fuse" in engine else "--quantize int8wo") in str(refused.value)
        # The unfused pin, and no pin, are served; for the base model the pin is ignored.
        unfused = await _image(client, adapter="ink", num_inference_steps=1, fuse="unfused")
        assert not unfused.fused
        assert (await _image(client, adapter="ink", num_inference_steps=1)).data == unfused.data
        assert not (await _image(client, num_inference_steps=1, fuse="fused")).fused
