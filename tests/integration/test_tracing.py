"""Generate traces from a real `shapes` server, received by a real OTLP/gRPC TraceService started here.

The receiver implements opentelemetry.proto.collector.trace.v1.TraceService (the published OTLP protos) on a
grpc.aio server and keeps every span exported to it; the server exports to it with `--otlp-endpoint`.
"""

from __future__ import annotations

import itertools
import sys

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from loraswap.server.config import SettingsError
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from loraswap.server.observability.tracing import MISSING_EXTRA
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.servers import address_of, server_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
ROOT_NAME = "loraswap.v1.DiffusionService/Generate"
PHASES = ["adapter_load", "queue_wait", "swap", "denoise", "decode"]


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.service_names: set[str] = set()

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    self.service_names.add(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_each_generate_is_one_trace_with_its_phases_joining_the_callers_trace():
    receiver = SpanReceiver()
    collector = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    collector_port = collector.add_insecure_port("127.0.0.1:0")
    await collector.start()
    settings = server_settings(
        "shapes", shapes_adapter_dir(), compile=False, otlp_endpoint=f"http://127.0.0.1:{collector_port}"
    )
    try:
        # Leaving the block stops the server, which flushes the pending spans to the collector still listening.
        async with serving(settings) as running, grpc.aio.insecure_channel(address_of(running)) as channel:
            stub = pb_grpc.DiffusionServiceStub(channel)
            traceparent = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
            joined = stub.Generate(
                pb.GenerateRequest(prompt="a red circle", adapter="outline", num_inference_steps=2, seed=1),
                metadata=(("traceparent", traceparent), ("x-request-id", "traced-1")),
            )
            images = [r.image async for r in joined if r.HasField("image")]
            base = stub.Generate(pb.GenerateRequest(prompt="a blue square", num_inference_steps=1))
            assert [r.image async for r in base if r.HasField("image")]
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                [r async for r in stub.Generate(pb.GenerateRequest(prompt="x", adapter="no-such-adapter"))]
            assert failed.value.code() == grpc.StatusCode.NOT_FOUND
            await stub.GetServerInfo(pb.GetServerInfoRequest())  # not traced
    finally:
        await collector.stop(0)

    assert receiver.service_names == {"loraswap"}
    roots = [span for span in receiver.spans if span.name == ROOT_NAME]
    assert len(roots) == 3 and len(receiver.spans) == 3 + 5 + 4  # cold: five phases; base: no load; failed: none
    by_trace = {span.trace_id.hex(): span for span in roots}
    assert len(by_trace) == 3

    # The caller's trace: our server span is the child of the caller's span.
    root = by_trace[CALLER_TRACE_ID]
    assert root.parent_span_id.hex() == CALLER_SPAN_ID
    assert root.kind == trace_pb2.Span.SPAN_KIND_SERVER
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["loraswap.request_id"].string_value == "traced-1"
    assert attributes["rpc.grpc.status_code"].string_value == "OK"
    children = sorted(
        (span for span in receiver.spans if span.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano
    )
    assert [span.name for span in children] == PHASES
    assert all(span.trace_id == root.trace_id for span in children)
    # Laid end to end, each as long as the image's timings say, inside the call's span.
    timings = images[0].timings
    expected_ms = [timings.adapter_load_ms, timings.queue_ms, timings.adapter_swap_ms, timings.denoise_ms,
                   timings.decode_ms]  # fmt: skip
    for span, ms in zip(children, expected_ms):
        assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6 == pytest.approx(ms, abs=0.001)
    for before, after in itertools.pairwise(children):
        assert before.end_time_unix_nano == after.start_time_unix_nano
    assert children[0].start_time_unix_nano == root.start_time_unix_nano
    assert children[-1].end_time_unix_nano <= root.end_time_unix_nano

    others = [span for trace_id, span in by_trace.items() if trace_id != CALLER_TRACE_ID]
    assert all(span.parent_span_id == b"" for span in others)  # no traceparent: a trace of its own
    (base,) = [span for span in others if span.status.code == trace_pb2.Status.STATUS_CODE_UNSET]
    assert sorted(s.name for s in receiver.spans if s.parent_span_id == base.span_id) == sorted(PHASES[1:])
    (refused,) = [span for span in others if span.status.code == trace_pb2.Status.STATUS_CODE_ERROR]
    assert refused.status.message == "ADAPTER_NOT_FOUND"
    assert not [s for s in receiver.spans if s.parent_span_id == refused.span_id]


async def test_otlp_endpoint_without_opentelemetry_stops_start_up_with_one_line(monkeypatch):
    # As if the `otlp` extra were not installed: the exporter's module cannot be imported.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    settings = server_settings("shapes", shapes_adapter_dir(), compile=False, otlp_endpoint="http://127.0.0.1:4317")
    with pytest.raises(SettingsError) as refused:
        async with serving(settings):
            pass
    assert str(refused.value) == MISSING_EXTRA and "\n" not in MISSING_EXTRA
