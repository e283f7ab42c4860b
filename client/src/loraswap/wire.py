"""The wire's facts that loraswap clients and servers must agree on, beside the stubs (loraswap.v1) they go with.

Both distributions import these from here, so that neither side restates them and the server never imports the
client: the call metadata key naming the adapter, the keepalive figures and the channel options made from them,
the contract's gRPC service config, and how a proto field is known to be repeated. Plain values: no grpc here.
"""

from __future__ import annotations

from importlib import resources

from google.protobuf.descriptor import FieldDescriptor

__all__ = [
    "CLIENT_KEEPALIVE_TIME_MS",
    "KEEPALIVE_TIMEOUT_MS",
    "LORA_METADATA_KEY",
    "SERVER_KEEPALIVE_TIME_MS",
    "SERVER_MIN_PING_INTERVAL_MS",
    "client_keepalive_options",
    "is_repeated",
    "server_keepalive_options",
    "service_config_json",
]

# The call metadata key naming a call's adapter (a stack: names separated by commas), as the seed system's
# clients sent a `lora` HTTP header: proxies route on it without parsing protobuf. Servers read it too.
LORA_METADATA_KEY = "lora"

# Keepalive. Load balancers and NAT tables drop connections idle for about a minute (AWS ALB and nginx: 60 s),
# and a Generate stream may stay quiet longer than that while it waits in the queue. Both sides therefore
# ping well inside a minute; the server accepts a client's pings down to half the client's interval, so timer
# slack never makes a ping arrive "too early" (two such strikes and the server would answer too_many_pings).
SERVER_MIN_PING_INTERVAL_MS = 10_000
CLIENT_KEEPALIVE_TIME_MS = 20_000
SERVER_KEEPALIVE_TIME_MS = 30_000
# An unanswered ping for this long means the peer is gone: the call fails with UNAVAILABLE instead of hanging.
KEEPALIVE_TIMEOUT_MS = 10_000


def server_keepalive_options() -> list[tuple[str, int]]:
    """grpc server options: ping idle clients, and accept client pings every SERVER_MIN_PING_INTERVAL_MS."""
    return [
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # The server-side name of GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS.
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        # Clients of other stacks may ping between calls; that is no abuse.
        ("grpc.keepalive_permit_without_calls", 1),
        # Keep pinging on a quiet stream (the default stops after two pings without data).
        ("grpc.http2.max_pings_without_data", 0),
    ]


def client_keepalive_options() -> list[tuple[str, int]]:
    """grpc channel options: ping every CLIENT_KEEPALIVE_TIME_MS while calls are open, as the server accepts."""
    return [
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Only while calls are open: an idle channel may close and reconnects on the next call.
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def service_config_json() -> str:
    """The contract's gRPC service config (protos/loraswap/v1/service_config.json): wait for ready, retry UNAVAILABLE."""
    return resources.files("loraswap.v1").joinpath("service_config.json").read_text(encoding="utf-8")


def is_map(descriptor: FieldDescriptor) -> bool:
    """Whether a field is a `map<K, V>` (a repeated entry message on the wire)."""
    return descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry


def is_repeated(descriptor: FieldDescriptor) -> bool:
    """Whether a field is repeated, on protobuf runtimes before and after `label` gave way to `is_repeated`."""
    if hasattr(descriptor, "is_repeated"):
        return descriptor.is_repeated
    return descriptor.label == FieldDescriptor.LABEL_REPEATED
