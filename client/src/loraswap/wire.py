"""The wire's facts that loraswap clients and servers must agree on, beside the stubs (loraswap.v1) they go with.

Both distributions import these from here, so that neither side restates them and the server never imports the
client: the call metadata key naming the adapter, the keepalive figures and the channel options made from them,
the contract's gRPC service config, and how a proto field is known to be repeated. Plain values: no grpc here.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from urllib.parse import parse_qsl, urlencode, urlsplit

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
    "url_identity",
]

# The call metadata key naming a call's adapter (a stack: names separated by commas), as the seed system's
# clients sent a `lora` HTTP header: proxies route on it without parsing protobuf. Servers read it too.
LORA_METADATA_KEY = "lora"

# URL adapters (the url-name of the proto's grammar) are known by an identity that leaves their query out, for
# the query of a presigned link or a model site's download is a secret (its signature, a token):
#     scheme "://" host [":" port] path ["?" 12HEXDIG] ["#sha256=" 64HEXDIG]
# The 12 hex digits digest the query's parameters that neither sign nor authorise the link, so links to one object
# signed anew each time are one identity. Clients send it as the `lora` metadata (proxies hash and log it, and
# the server refuses a secret nowhere), and servers key their caches, replies and logs by it.
SIGNING_PREFIXES = ("x-amz-", "x-goog-")
# S3 (v4, v2), GCS (v4, v2), Azure SAS, CloudFront, and the usual token parameters of model sites.
SIGNING_PARAMETERS = frozenset(
    {
        "awsaccesskeyid", "signature", "expires", "googleaccessid", "key-pair-id", "policy",
        "sv", "ss", "srt", "sp", "se", "st", "spr", "sig", "si", "sr", "sdd", "skoid", "sktid", "skt", "ske", "sks",
        "skv", "saoid", "suoid", "scid", "ses",
        "token", "access_token", "auth", "api_key", "apikey",
    }
)  # fmt: skip
QUERY_DIGEST_HEX = 12
URL_DEFAULT_PORTS = {"https": 443, "http": 80}


def _query_digest(query: str) -> str:
    """A query's stand-in: a digest of its parameters that are not signing ones ("" for none); a bare 12-hex query
    is an identity's digest already, kept as it is."""
    if len(query) == QUERY_DIGEST_HEX and all(character in "0123456789abcdef" for character in query):
        return query
    kept = sorted(
        (key, value)
        for key, value in parse_qsl(query, keep_blank_values=True)
        if not (key.lower() in SIGNING_PARAMETERS or key.lower().startswith(SIGNING_PREFIXES))
    )
    return hashlib.sha256(urlencode(kept).encode()).hexdigest()[:QUERY_DIGEST_HEX] if kept else ""


def url_identity(url: str) -> str:
    """The identity of an adapter URL (see above); ValueError for one with no http(s) scheme, host or valid port.

    The server checks the rest of the grammar (and says what is wrong); this only writes the identity."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in URL_DEFAULT_PORTS or not parts.hostname:
        raise ValueError("not an http(s) URL with a host")
    host = parts.hostname.lower()
    port = parts.port or URL_DEFAULT_PORTS[scheme]
    shown_host = f"[{host}]" if ":" in host else host
    origin = f"{scheme}://{shown_host}" + ("" if port == URL_DEFAULT_PORTS[scheme] else f":{port}")
    digest = _query_digest(parts.query)
    fragment = parts.fragment.lower() if parts.fragment.lower().startswith("sha256=") else ""
    return origin + (parts.path or "/") + (f"?{digest}" if digest else "") + (f"#{fragment}" if fragment else "")


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
