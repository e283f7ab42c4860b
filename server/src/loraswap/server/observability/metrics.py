"""Prometheus metrics of one server, in a registry of its own, served as text on `--metrics-port`.

Counters and histograms are fed as things happen (the engine's observer, the end of each call). Levels (queue
depth, cache bytes and entries) and the recompilation count are read from the engine when scraped, through
`DiffusionEngine.gauges()`, which takes only short locks: a scrape never waits for a denoising step.

Every labelled series whose labels are known in advance (each RPC with code OK, each RPC's duration, each swap
path, each ErrorInfo reason) exists from the start, at zero, so `rate()` and alerts see a fresh replica; only
the per-adapter counter waits for names, which are not known in advance.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from loraswap.server.engine.errors import ErrorReason
from loraswap.server.engine.observer import EngineGauges, EngineObserver, SwapMode, SwapPath
from loraswap.server.observability.calls import RPC_METHODS, CallRecord

log = logging.getLogger(__name__)

OTHER_ADAPTERS = "_other"
DEFAULT_MAX_ADAPTER_LABELS = 100

# Bucket bounds in seconds, each fitted to what it measures.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SWAP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _EngineLevels(Collector):
    """Reads the engine's levels at scrape time."""

    def __init__(self, read: Callable[[], EngineGauges | None]) -> None:
        self._read = read

    def describe(self):
        return self._families(None)

    def collect(self):
        return self._families(self._read())

    @staticmethod
    def _families(gauges: EngineGauges | None):
        families = [
            (GaugeMetricFamily("loraswap_queue_depth", "Generate requests waiting for the worker."), "queue_depth"),
            (GaugeMetricFamily("loraswap_adapter_cache_bytes", "Bytes of the cached adapters."), "cache_bytes"),
            (GaugeMetricFamily("loraswap_adapter_cache_entries", "Adapters in the host cache."), "cache_entries"),
            (
                CounterMetricFamily(
                    "loraswap_recompilations", "Graphs compiled since warm-up ended (GetServerInfo.recompilations)."
                ),
                "recompilations",
            ),
        ]
        if gauges is not None:
            for family, field in families:
                family.add_metric([], getattr(gauges, field))
        return [family for family, _ in families]


class _QuietRequestHandler(WSGIRequestHandler):
    """wsgiref's request handler, without its line on stderr for every request (as prometheus-client's own)."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class MetricsHTTPServer(ThreadingWSGIServer):
    """prometheus-client's threaded WSGI server, whose failed connections are logged in one line.

    http.server answers an oversized request line (414) or header (431) itself; what socketserver does when a
    connection then fails (a reset, a broken pipe) is print a plain traceback on stderr, into a JSON log too.
    """

    def __init__(self, host: str, port: int) -> None:
        # The family the host needs ("::" is IPv6); socketserver's default is IPv4 only.
        (family, *_), *_ = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self.address_family = family
        super().__init__((host, port), _QuietRequestHandler)

    def handle_error(self, request: object, client_address: object) -> None:
        error = sys.exc_info()[1]
        client = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        if isinstance(error, OSError):
            # The client reset, closed or stalled its connection: its doing, nothing to debug here.
            log.info("a metrics client's connection failed: %s", error, extra={"client": client})
        else:
            log.error("a metrics request failed", exc_info=error, extra={"client": client})


def _logging_failures(app: Callable) -> Callable:
    """prometheus-client's WSGI app, with a failure to collect logged (wsgiref would print it on stderr)."""

    def metrics_app(environ, start_response) -> Iterable[bytes]:
        try:
            return app(environ, start_response)
        except Exception:
            log.exception("could not collect the metrics for a scrape")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")], sys.exc_info())
            return [b"could not collect the metrics; the server's log says why\n"]

    return metrics_app


# The outcomes of URL fetches that gave a file (observer.url_download); any other outcome is a failure's reason.
URL_DOWNLOAD_OUTCOMES = ("downloaded", "not_modified", "disk")


class MetricsEngineObserver(EngineObserver):
    """Turns the engine's events into observations of ServerMetrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def cache_lookup(self, hit: bool) -> None:
        (self._m.cache_hits if hit else self._m.cache_misses).inc()

    def adapter_loaded(self, seconds: float) -> None:
        self._m.adapter_load_seconds.observe(seconds)

    def adapters_evicted(self, count: int) -> None:
        self._m.evictions.inc(count)

    def url_download(self, host: str, outcome: str, transferred_bytes: int) -> None:
        if transferred_bytes:
            self._m.url_download_bytes.labels(host=host).inc(transferred_bytes)
        if outcome in URL_DOWNLOAD_OUTCOMES:
            self._m.url_downloads.labels(host=host, outcome=outcome).inc()
        else:
            self._m.url_download_failures.labels(host=host, reason=outcome).inc()

    def job_dequeued(self, wait_seconds: float) -> None:
        self._m.queue_wait_seconds.observe(wait_seconds)

    def swapped(self, path: SwapPath, mode: SwapMode, seconds: float) -> None:
        self._m.swaps.labels(mode=mode.value).inc()
        self._m.swap_seconds.labels(path=path.value, mode=mode.value).observe(seconds)

    def step_done(self, seconds: float) -> None:
        self._m.step_seconds.observe(seconds)

    def image_done(self) -> None:
        self._m.images.inc()


class ServerMetrics:
    """Every loraswap_* metric of one server, in its own CollectorRegistry (several servers share no state)."""

    def __init__(self, max_adapter_labels: int = DEFAULT_MAX_ADAPTER_LABELS) -> None:
        # Exactly the documented names: no `*_created` series beside each counter and histogram. (The switch is
        # prometheus-client's, process-wide; this process is a server and its metrics are these.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "loraswap_requests", "DiffusionService calls by method and gRPC status code.", ["method", "code"],
            registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "loraswap_request_seconds", "Duration of DiffusionService calls.", ["method"], buckets=REQUEST_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.queue_wait_seconds = Histogram(
            "loraswap_queue_wait_seconds", "Time Generate requests waited in the queue for the worker.",
            buckets=QUEUE_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "loraswap_step_seconds", "Duration of each denoising step of served requests.", buckets=STEP_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.images = Counter("loraswap_images", "Generations that finished with an image.", registry=r)
        self.swaps = Counter(
            "loraswap_adapter_swaps",
            "Changes of the resident adapters (base model included); mode=fused when merged into the base weights, "
            "unfused when copied into the swap slot.",
            ["mode"], registry=r,
        )  # fmt: skip
        self.swap_seconds = Histogram(
            "loraswap_adapter_swap_seconds",
            "Duration of swap-slot changes; path=cold when the request first had to load an adapter it swapped in "
            "(read, convert, validate), warm when every adapter was already cached; mode as for loraswap_adapter_swaps.",
            ["path", "mode"], buckets=SWAP_BUCKETS, registry=r,
        )  # fmt: skip
        self.adapter_load_seconds = Histogram(
            "loraswap_adapter_load_seconds", "Adapter loads into the cache: read + convert + validate.",
            buckets=LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.cache_hits = Counter("loraswap_adapter_cache_hits", "Adapter lookups found in the cache.", registry=r)
        self.cache_misses = Counter(
            "loraswap_adapter_cache_misses", "Adapter lookups not in the cache (a load started or joined).", registry=r
        )
        self.evictions = Counter(
            "loraswap_adapter_evictions", "Adapters that left the cache (Evict calls and the byte budget).", registry=r
        )
        self.errors = Counter(
            "loraswap_errors", "DiffusionService calls that failed, by ErrorInfo reason.", ["reason"], registry=r
        )
        self.adapter_requests = Counter(
            "loraswap_adapter_requests",
            f"Generate calls that produced an image, per adapter applied (each member of a stack); beyond "
            f"{max_adapter_labels} adapter names (--metrics-max-adapters) the rest count as adapter={OTHER_ADAPTERS}.",
            ["adapter"], registry=r,
        )  # fmt: skip
        # URL adapters, by the --allow-url-host rule that allowed them (a bounded set: never the URL's own host).
        self.url_downloads = Counter(
            "loraswap_url_downloads",
            "URL adapter fetches that gave a file, by allowed host rule; outcome=downloaded (the body came), "
            "not_modified (revalidated: the file on disk served), disk (pinned by #sha256= and on disk: nothing sent).",
            ["host", "outcome"], registry=r,
        )  # fmt: skip
        self.url_download_bytes = Counter(
            "loraswap_url_download_bytes", "Body bytes of URL adapter downloads (failed ones too), by allowed host rule.",
            ["host"], registry=r,
        )  # fmt: skip
        self.url_download_failures = Counter(
            "loraswap_url_download_failures", "URL adapter fetches that failed, by allowed host rule and ErrorInfo reason.",
            ["host", "reason"], registry=r,
        )  # fmt: skip
        self.build_info = Gauge(
            "loraswap_build_info", "1, labelled with the server's version and its model.",
            ["version", "model", "family", "dtype", "device"], registry=r,
        )  # fmt: skip
        # The series known in advance, at zero from the start (see the module's docstring).
        for method in RPC_METHODS:
            self.requests.labels(method=method, code="OK")
            self.request_seconds.labels(method=method)
        for mode in SwapMode:
            self.swaps.labels(mode=mode.value)
            for path in SwapPath:
                self.swap_seconds.labels(path=path.value, mode=mode.value)
        for reason in ErrorReason:
            self.errors.labels(reason=reason.value)
        self._max_adapter_labels = max_adapter_labels
        self._adapter_labels: set[str] = set()
        self._labels_lock = threading.Lock()
        self._levels: Callable[[], EngineGauges] | None = None
        r.register(_EngineLevels(lambda: self._levels() if self._levels is not None else None))
        self.engine_observer = MetricsEngineObserver(self)
        self._http: MetricsHTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    def know_url_hosts(self, hosts: tuple[str, ...]) -> None:
        """Start the URL series of each allowed host rule at zero."""
        for host in hosts:
            self.url_download_bytes.labels(host=host)
            for outcome in URL_DOWNLOAD_OUTCOMES:
                self.url_downloads.labels(host=host, outcome=outcome)

    def read_levels_from(self, levels: Callable[[], EngineGauges]) -> None:
        """Read queue depth, cache bytes and entries and recompilations from `levels` at each scrape."""
        self._levels = levels

    def set_build_info(self, *, version: str, model: str, family: str, dtype: str, device: str) -> None:
        self.build_info.labels(version=version, model=model, family=family, dtype=dtype, device=device).set(1)

    def call_ended(self, record: CallRecord) -> None:
        """Count a finished call: its method and code, duration, error reason and the adapters it used."""
        self.requests.labels(method=record.method, code=record.code).inc()
        self.request_seconds.labels(method=record.method).observe(record.duration_s)
        if record.reason:
            self.errors.labels(reason=record.reason).inc()
        if record.method == "Generate" and record.timings is not None:
            for adapter in record.adapters:
                self.adapter_requests.labels(adapter=self._adapter_label(adapter)).inc()

    def _adapter_label(self, adapter: str) -> str:
        with self._labels_lock:
            if adapter in self._adapter_labels:
                return adapter
            if len(self._adapter_labels) < self._max_adapter_labels:
                self._adapter_labels.add(adapter)
                return adapter
        return OTHER_ADAPTERS

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on a thread of its own; returns the port bound (`port` 0: the OS picks)."""
        self._http = MetricsHTTPServer(host.strip("[]"), port)
        self._http.set_app(_logging_failures(make_wsgi_app(self.registry)))
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True)
        self._http_thread.start()
        return self._http.server_port

    def close(self) -> None:
        """Stop serving /metrics."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
