"""OpenTelemetry traces of Generate calls, exported over OTLP/gRPC to `--otlp-endpoint` (the `otlp` extra).

One trace per Generate: a server span for the call, with a child span for each phase of the image's
timings, laid end to end in the order they happen: `adapter_load` (only when the request loaded an
adapter), `queue_wait`, `swap`, `denoise`, `decode`. The phases are measured by the engine and known
when the image comes out, so the spans are made then, with explicit start and end times. A caller's
`traceparent` (W3C trace context) makes the call's span a child of the caller's.

Each server has a TracerProvider of its own (none is installed globally), so several servers in one
process do not mix their spans.
"""

from __future__ import annotations

from loraswap.server.config import SettingsError
from loraswap.server.observability import server_version
from loraswap.server.observability.calls import CallRecord

SERVICE_NAME = "loraswap"
RPC_SERVICE = "loraswap.v1.DiffusionService"
MISSING_EXTRA = (
    "--otlp-endpoint needs OpenTelemetry, which is not installed: pip install 'loraswap-server[otlp]' "
    "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc), or drop --otlp-endpoint"
)


class GenerateTracer:
    """Makes the spans of each finished Generate call and exports them in batches."""

    def __init__(self, endpoint: str) -> None:
        """Raises SettingsError when the OpenTelemetry packages (the `otlp` extra) are missing."""
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise SettingsError(MISSING_EXTRA) from None
        # An endpoint without a scheme is plaintext, as the OTLP exporter's own default (http://localhost:4317).
        if "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": server_version()})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("loraswap.server", server_version())
        self._propagator = TraceContextTextMapPropagator()

    def call_ended(self, record: CallRecord) -> None:
        """Export the spans of a finished Generate call (other calls are not traced)."""
        if record.method != "Generate":
            return
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = self._propagator.extract(carrier=record.trace_headers)
        span = self._tracer.start_span(
            f"{RPC_SERVICE}/Generate", context=parent, kind=SpanKind.SERVER, start_time=record.started_unix_ns,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": RPC_SERVICE,
                "rpc.method": "Generate",
                "rpc.grpc.status_code": record.code,
                "loraswap.request_id": record.request_id,
                "loraswap.adapters": list(record.adapters),
            },
        )  # fmt: skip
        if record.code != "OK":
            span.set_status(Status(StatusCode.ERROR, record.reason or record.code))
        if record.timings is not None:
            inside = trace.set_span_in_context(span)
            at = record.started_unix_ns
            timings = record.timings
            phases = [
                ("adapter_load", timings.adapter_load_ms),
                ("queue_wait", timings.queue_ms),
                ("swap", timings.adapter_swap_ms),
                ("denoise", timings.denoise_ms),
                ("decode", timings.decode_ms),
            ]
            for name, ms in phases:
                if name == "adapter_load" and ms <= 0:
                    continue
                ends = at + round(ms * 1e6)
                self._tracer.start_span(name, context=inside, start_time=at).end(end_time=ends)
                at = ends
        span.end(end_time=max(record.ended_unix_ns, record.started_unix_ns))

    def close(self) -> None:
        """Export what is pending, then stop."""
        self._provider.shutdown()
