"""Everything that watches one server, made from its Settings: metrics, the access log, traces."""

from __future__ import annotations

import logging

from loraswap.server.config import Settings
from loraswap.server.engine.interface import Engine
from loraswap.server.engine.observer import NO_OBSERVER, EngineObserver
from loraswap.server.engine.types import ServerDescription
from loraswap.server.observability import server_version
from loraswap.server.observability.access_log import AccessLog
from loraswap.server.observability.calls import CallRecord
from loraswap.server.observability.metrics import ServerMetrics

log = logging.getLogger(__name__)


class ServerObservers:
    """The metrics (with --metrics-port), the access log, and the Generate tracer (with --otlp-endpoint)."""

    def __init__(self, settings: Settings) -> None:
        """Raises SettingsError when --otlp-endpoint is given without the OpenTelemetry packages."""
        self.settings = settings
        self.metrics = (
            ServerMetrics(max_adapter_labels=settings.metrics_max_adapters)
            if settings.metrics_port is not None
            else None
        )
        if self.metrics is not None:
            engine = settings.engine
            self.metrics.know_url_hosts(tuple(dict.fromkeys(engine.allow_insecure_url_host + engine.allow_url_host)))
        self.access_log = AccessLog(log_prompts=settings.log_prompts)
        self.tracer = None
        if settings.otlp_endpoint:
            from loraswap.server.observability.tracing import GenerateTracer

            self.tracer = GenerateTracer(settings.otlp_endpoint)
        self.metrics_port: int | None = None

    @property
    def engine_observer(self) -> EngineObserver:
        """What the engine should report its events to."""
        return self.metrics.engine_observer if self.metrics is not None else NO_OBSERVER

    def watch_engine(self, engine: Engine) -> None:
        """Read the engine's levels at each scrape."""
        if self.metrics is not None:
            self.metrics.read_levels_from(engine.gauges)

    def start(self) -> None:
        """Serve /metrics (with --metrics-port)."""
        if self.metrics is not None:
            self.metrics_port = self.metrics.serve(self.settings.host, self.settings.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.settings.host, self.metrics_port)
        if self.tracer is not None:
            log.info("exporting Generate traces to %s", self.settings.otlp_endpoint)

    def serving(self, description: ServerDescription) -> None:
        """The model is loaded and warm: publish loraswap_build_info."""
        if self.metrics is not None:
            self.metrics.set_build_info(
                version=server_version(), model=description.model, family=description.family.value,
                dtype=description.dtype, device=description.device,
            )  # fmt: skip

    def call_ended(self, record: CallRecord) -> None:
        """Count, log and trace a finished call; an observer's failure is logged and never reaches the caller."""
        for observer in (self.metrics, self.access_log, self.tracer):
            if observer is None:
                continue
            try:
                observer.call_ended(record)
            except Exception:
                log.exception("%s could not record a %s call", type(observer).__name__, record.method)

    def close(self) -> None:
        """Stop serving /metrics and export the traces still pending."""
        if self.metrics is not None:
            self.metrics.close()
        if self.tracer is not None:
            self.tracer.close()
