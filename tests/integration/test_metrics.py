"""Prometheus /metrics of a real `shapes` server: the documented names and types, and exact deltas per request.

Each test scrapes /metrics over HTTP before and after real calls through the real client (a cold load and a
swap, a warm swap, an Evict, refused requests) and compares every counter, histogram count and gauge.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from loraswap.client import InvalidRequest, NotFound
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from tests.support.engines import ScriptedEngine, one_step
from tests.support.servers import client_of, server_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a red circle on a blue background"
STEPS = 2

EXPOSED = {
    "loraswap_requests_total": "counter",
    "loraswap_request_seconds": "histogram",
    "loraswap_queue_depth": "gauge",
    "loraswap_queue_wait_seconds": "histogram",
    "loraswap_step_seconds": "histogram",
    "loraswap_images_total": "counter",
    "loraswap_adapter_swaps_total": "counter",
    "loraswap_adapter_swap_seconds": "histogram",
    "loraswap_adapter_load_seconds": "histogram",
    "loraswap_adapter_cache_bytes": "gauge",
    "loraswap_adapter_cache_entries": "gauge",
    "loraswap_adapter_cache_hits_total": "counter",
    "loraswap_adapter_cache_misses_total": "counter",
    "loraswap_adapter_evictions_total": "counter",
    "loraswap_recompilations_total": "counter",
    "loraswap_errors_total": "counter",
    "loraswap_adapter_requests_total": "counter",
    "loraswap_build_info": "gauge",
    "loraswap_url_downloads_total": "counter",
    "loraswap_url_download_bytes_total": "counter",
    "loraswap_url_download_failures_total": "counter",
}


def metrics_settings(**changes):
    """An eager `shapes` server with /metrics on a port the OS picks; `changes` as server_settings takes them."""
    return server_settings("shapes", shapes_adapter_dir(), **{"compile": False, "metrics_port": 0, **changes})


async def scrape_text(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            return response.read().decode()

    return await asyncio.to_thread(get)


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, by (name, sorted labels)."""
    samples = {}
    for family in text_string_to_metric_families(await scrape_text(port)):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def deltas(before, after) -> dict:
    """What changed, leaving out durations (sums, buckets) and build info; a new series counts from 0."""
    changed = {}
    for key, value in after.items():
        name = key[0]
        if name.endswith(("_sum", "_bucket")) or name == "loraswap_build_info":
            continue
        delta = value - before.get(key, 0.0)
        if delta:
            changed[key] = delta
    return changed


def key(name: str, **labels: str):
    return (name, tuple(sorted(labels.items())))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served():
    async with serving(metrics_settings()) as running, client_of(running) as client:
        yield running, client


async def test_a_cold_load_a_swap_an_eviction_and_refusals_change_exactly_their_metrics(served):
    running, client = served
    before = await scrape(running.metrics_port)
    # Cold: swap-colors is not cached yet, so it is read, converted and validated, then swapped in.
    cold = await client.generate_image(PROMPT, adapter="swap-colors", seed=1, num_inference_steps=STEPS)
    assert cold.timings.adapter_load_ms > 0
    # Warm: cached now; another strength is a swap without a load.
    warm = await client.generate_image(
        PROMPT, adapter="swap-colors", adapter_scale=0.5, seed=1, num_inference_steps=STEPS
    )
    assert warm.timings.adapter_load_ms == 0
    freed = await client.evict("swap-colors")
    assert freed > 0
    with pytest.raises(InvalidRequest) as refused:
        await client.generate_image(PROMPT, num_inference_steps=0)
    with pytest.raises(NotFound, match="ADAPTER_NOT_FOUND"):
        await client.generate_image(PROMPT, adapter="no-such-adapter", num_inference_steps=STEPS)
    after = await scrape(running.metrics_port)

    # Each swap counts under the mode the server chose for it (--fuse auto), as its image says.
    cold_mode, warm_mode = ("fused" if image.fused else "unfused" for image in (cold, warm))
    swaps_by_mode = {mode: [cold_mode, warm_mode].count(mode) for mode in {cold_mode, warm_mode}}
    assert deltas(before, after) == {
        key("loraswap_requests_total", method="Generate", code="OK"): 2,
        key("loraswap_requests_total", method="Evict", code="OK"): 1,
        key("loraswap_requests_total", method="Generate", code="INVALID_ARGUMENT"): 1,
        key("loraswap_requests_total", method="Generate", code="NOT_FOUND"): 1,
        key("loraswap_request_seconds_count", method="Generate"): 4,
        key("loraswap_request_seconds_count", method="Evict"): 1,
        key("loraswap_queue_wait_seconds_count"): 2,
        key("loraswap_step_seconds_count"): 2 * STEPS,
        key("loraswap_images_total"): 2,
        **{key("loraswap_adapter_swaps_total", mode=mode): count for mode, count in swaps_by_mode.items()},
        key("loraswap_adapter_swap_seconds_count", path="cold", mode=cold_mode): 1,
        key("loraswap_adapter_swap_seconds_count", path="warm", mode=warm_mode): 1,
        key("loraswap_adapter_load_seconds_count"): 1,
        key("loraswap_adapter_cache_misses_total"): 2,  # swap-colors, then the unknown name
        key("loraswap_adapter_cache_hits_total"): 1,
        key("loraswap_adapter_evictions_total"): 1,
        key("loraswap_errors_total", reason=refused.value.reason): 1,
        key("loraswap_errors_total", reason="ADAPTER_NOT_FOUND"): 1,
        key("loraswap_adapter_requests_total", adapter="swap-colors"): 2,
    }
    # Every observation fell in some bucket: +Inf counts what _count counts.
    for name, labels in (
        ("loraswap_adapter_swap_seconds", {"path": "cold", "mode": cold_mode}),
        ("loraswap_step_seconds", {}),
    ):
        inf = after[key(f"{name}_bucket", le="+Inf", **labels)] - before.get(
            key(f"{name}_bucket", le="+Inf", **labels), 0
        )
        assert inf == after[key(f"{name}_count", **labels)] - before.get(key(f"{name}_count", **labels), 0)
    # The load took what the image's timings say it took.
    load_sum = after[key("loraswap_adapter_load_seconds_sum")] - before.get(key("loraswap_adapter_load_seconds_sum"), 0)
    assert load_sum == pytest.approx(cold.timings.adapter_load_ms / 1000.0, rel=1e-6)


PATH_COLD_UNFUSED = {"path": "cold", "mode": "unfused", "le": ""}


async def test_exposed_names_types_labels_and_buckets(served):
    running, client = served
    await client.generate_image(PROMPT, adapter="outline", seed=2, num_inference_steps=STEPS)
    text = await scrape_text(running.metrics_port)
    types = dict(re.findall(r"^# TYPE (loraswap_\w+) (\w+)$", text, flags=re.MULTILINE))
    assert types == EXPOSED
    assert not re.search(r"^loraswap_\w+_created", text, flags=re.MULTILINE)
    samples = await scrape(running.metrics_port)
    info = await client.server_info()
    build = [labels for (name, labels) in samples if name == "loraswap_build_info"]
    assert len(build) == 1
    assert dict(build[0]) | {"version": "?"} == {
        "version": "?", "model": "shapes", "family": "flux", "dtype": info.dtype, "device": info.device,
    }  # fmt: skip
    assert samples[key("loraswap_recompilations_total")] == info.recompilations
    listing = await client.list_adapters()
    samples = await scrape(running.metrics_port)
    assert samples[key("loraswap_adapter_cache_entries")] == len(listing.adapters)
    assert samples[key("loraswap_adapter_cache_bytes")] == listing.cache_bytes
    swap_bounds = sorted(
        float(dict(labels)["le"])
        for name, labels in samples
        if name == "loraswap_adapter_swap_seconds_bucket" and dict(labels) | {"le": ""} == PATH_COLD_UNFUSED
    )
    assert swap_bounds[0] == 0.0001 and swap_bounds[-2] == 10.0
    request_bounds = sorted(
        float(dict(labels)["le"])
        for name, labels in samples
        if name == "loraswap_request_seconds_bucket" and dict(labels)["method"] == "Generate"
    )
    assert request_bounds[-2] == 600.0


async def test_queue_depth_is_read_while_a_generation_runs(served):
    running, client = served
    jobs = [asyncio.ensure_future(client.generate_image(PROMPT, seed=i, num_inference_steps=12)) for i in range(3)]
    deepest = 0
    try:
        while not all(job.done() for job in jobs):
            depth = (await scrape(running.metrics_port))[key("loraswap_queue_depth")]
            deepest = max(deepest, depth)
            await asyncio.sleep(0.02)
    finally:
        await asyncio.gather(*jobs)
    # While the first ran, the others waited, and the scrape (between steps or during one) saw them.
    assert deepest >= 1
    assert (await scrape(running.metrics_port))[key("loraswap_queue_depth")] == 0


async def test_adapter_labels_are_capped_and_a_stack_counts_each_member():
    async with serving(metrics_settings(metrics_max_adapters=1, max_rank=32)) as running, client_of(running) as client:
        await client.generate_image(PROMPT, adapters=["outline", "purple"], seed=3, num_inference_steps=1)
        await client.generate_image(PROMPT, adapter="swap-colors", seed=3, num_inference_steps=1)
        await client.generate_image(PROMPT, adapter="outline", seed=3, num_inference_steps=1)
        samples = await scrape(running.metrics_port)
    per_adapter = {
        dict(labels)["adapter"]: value for (name, labels), value in samples.items()
        if name == "loraswap_adapter_requests_total"
    }  # fmt: skip
    assert per_adapter == {"outline": 2, "_other": 2}


async def test_no_metrics_port_means_no_metrics_server():
    async with serving(metrics_settings(metrics_port=None), engine=ScriptedEngine(one_step)) as running:
        assert running.metrics_port is None
        assert running.observers.metrics is None
