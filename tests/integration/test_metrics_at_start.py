"""A fresh `shapes` server's /metrics, before any call: every family the README lists, with its known series at 0.

Prometheus advises exporting every known series from the start: a labelled series that appears only with its
first event leaves `rate()` and alerts blind on a fresh replica. Only the per-adapter counter waits, since its
adapter names are not known in advance.
"""

from __future__ import annotations

import pytest

from loraswap.server.engine.errors import ErrorReason
from loraswap.v1 import diffusion_service_pb2 as pb
from tests.integration.test_metrics import EXPOSED, key, metrics_settings, scrape
from tests.support.servers import serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONTRACT_RPCS = [method.name for method in pb.DESCRIPTOR.services_by_name["DiffusionService"].methods]
SWAP_PATHS = ("cold", "warm")
SWAP_MODES = ("fused", "unfused")
# The families whose series wait for what they are labelled with: adapter names; the URL hosts a server allows
# (none here; see the test below) and the reasons URL fetches fail for.
URL_FAMILIES = {
    "loraswap_url_downloads_total",
    "loraswap_url_download_bytes_total",
    "loraswap_url_download_failures_total",
}
WAITING = {"loraswap_adapter_requests_total", *URL_FAMILIES}


async def test_a_fresh_server_exports_every_known_series_at_zero() -> None:
    async with serving(metrics_settings()) as running:
        samples = await scrape(running.metrics_port)
    zero = [
        *(key("loraswap_requests_total", method=rpc, code="OK") for rpc in CONTRACT_RPCS),
        *(key("loraswap_request_seconds_count", method=rpc) for rpc in CONTRACT_RPCS),
        *(key("loraswap_request_seconds_bucket", method=rpc, le="+Inf") for rpc in CONTRACT_RPCS),
        *(
            key("loraswap_adapter_swap_seconds_count", path=path, mode=mode)
            for path in SWAP_PATHS
            for mode in SWAP_MODES
        ),
        *(
            key("loraswap_adapter_swap_seconds_bucket", path=path, mode=mode, le="+Inf")
            for path in SWAP_PATHS
            for mode in SWAP_MODES
        ),
        *(key("loraswap_adapter_swaps_total", mode=mode) for mode in SWAP_MODES),
        *(key("loraswap_errors_total", reason=reason.value) for reason in ErrorReason),
        key("loraswap_queue_depth"),
        key("loraswap_queue_wait_seconds_count"),
        key("loraswap_step_seconds_count"),
        key("loraswap_images_total"),
        key("loraswap_adapter_load_seconds_count"),
        key("loraswap_adapter_cache_hits_total"),
        key("loraswap_adapter_cache_misses_total"),
        key("loraswap_adapter_evictions_total"),
        key("loraswap_recompilations_total"),
        # Nothing preloaded or pinned: the host cache is empty until the first adapter is asked for.
        key("loraswap_adapter_cache_entries"),
        key("loraswap_adapter_cache_bytes"),
    ]
    assert {series: samples.get(series) for series in zero} == dict.fromkeys(zero, 0.0)
    # Every listed family has samples.
    families = {name for name, _ in samples}
    for family, kind in EXPOSED.items():
        names = {f"{family}_count"} if kind == "histogram" else {family}
        assert (names <= families) == (family not in WAITING), family
    (build,) = [value for (name, _), value in samples.items() if name == "loraswap_build_info"]
    assert build == 1


async def test_a_server_that_allows_url_hosts_exports_their_series_at_zero(tmp_path) -> None:
    hosts = ("*.example.com", "huggingface.co")
    async with serving(metrics_settings(allow_url_host=hosts, adapter_cache_dir=tmp_path)) as running:
        samples = await scrape(running.metrics_port)
    zero = [
        *(
            key("loraswap_url_downloads_total", host=host, outcome=outcome)
            for host in ("*.example.com", "huggingface.co")
            for outcome in ("downloaded", "not_modified", "disk")
        ),
        *(key("loraswap_url_download_bytes_total", host=host) for host in ("*.example.com", "huggingface.co")),
    ]
    assert {series: samples.get(series) for series in zero} == dict.fromkeys(zero, 0.0)
    assert "loraswap_url_download_failures_total" not in {name for name, _ in samples}  # by reason, as they come
