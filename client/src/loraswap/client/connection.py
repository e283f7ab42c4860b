"""How loraswap clients and servers meet on the wire: the numbers both sides must agree on, and client channels.

The server imports its keepalive settings from here, so that the two sides cannot drift apart: a client
that pings more often than the server allows gets its connection closed with GOAWAY `too_many_pings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources

import grpc

__all__ = [
    "CLIENT_KEEPALIVE_TIME_MS",
    "KEEPALIVE_TIMEOUT_MS",
    "SERVER_KEEPALIVE_TIME_MS",
    "SERVER_MIN_PING_INTERVAL_MS",
    "TlsConfig",
    "client_channel_options",
    "open_channel",
    "server_keepalive_options",
    "service_config_json",
]

# Keepalive. Load balancers and NAT tables drop connections idle for about a minute (AWS ALB and nginx: 60 s),
# and a Generate stream may stay quiet longer than that while it waits in the queue. Both sides therefore
# ping well inside a minute; the server accepts a client's pings down to half the client's interval, so timer
# slack never makes a ping arrive "too early" (two such strikes and the server would answer too_many_pings).
# The call metadata key naming a call's adapter (a stack: names separated by commas), as the seed system's
# clients sent a `lora` HTTP header: proxies route on it without parsing protobuf. Servers read it too.
LORA_METADATA_KEY = "lora"
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


def _client_keepalive_options() -> list[tuple[str, int]]:
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


def client_channel_options() -> list[tuple[str, int | str]]:
    """Options of the channels the loraswap clients open: keepalive and the service config.

    The receive limit stays at gRPC's default 4 MiB: a loraswap server sends images in pieces of at most
    1 MiB and never sends a message over 4 MiB.
    """
    return [
        *_client_keepalive_options(),
        ("grpc.service_config", service_config_json()),
        ("grpc.enable_retries", 1),
    ]


@dataclass(frozen=True)
class TlsConfig:
    """How a client checks the server's certificate, and the certificate it shows for mTLS.

    Attributes:
        ca_bundle: PEM certificates the server's certificate must chain to; None trusts gRPC's default roots.
        client_certificate: PEM certificate chain for servers that require client certificates (mTLS).
        client_key: PEM private key of ``client_certificate``.
    """

    ca_bundle: bytes | None = None
    client_certificate: bytes | None = None
    client_key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.client_certificate is None) != (self.client_key is None):
            raise ValueError("a client certificate needs its private key, and a key its certificate")

    @classmethod
    def from_files(
        cls,
        ca_bundle: str | os.PathLike[str] | None = None,
        client_certificate: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
    ) -> TlsConfig:
        """Reads the PEM files given; those left as None stay unset."""

        def read(path: str | os.PathLike[str] | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as file:
                return file.read()

        return cls(ca_bundle=read(ca_bundle), client_certificate=read(client_certificate), client_key=read(client_key))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The gRPC channel credentials for this configuration."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_bundle, private_key=self.client_key, certificate_chain=self.client_certificate
        )


def open_channel(target: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a loraswap server at ``target``: TLS when ``tls`` is given, else plaintext.

    Must be called with the event loop that will use the channel running (gRPC binds the channel to it).
    """
    if tls is None:
        return grpc.aio.insecure_channel(target, options=client_channel_options())
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=client_channel_options())
