"""How a loraswap client opens its channels: TLS or plaintext, with the options the wire asks for.

The numbers both sides must agree on live in loraswap.wire, which the server imports too, so that the two sides
cannot drift apart: a client that pings more often than the server allows gets its connection closed with GOAWAY
`too_many_pings`. They are re-exported here, where clients found them before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

# Re-exported where clients found them before (loraswap.wire declares them); unused here, hence the noqa.
from loraswap.wire import (  # noqa: F401
    CLIENT_KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    LORA_METADATA_KEY,
    SERVER_KEEPALIVE_TIME_MS,
    SERVER_MIN_PING_INTERVAL_MS,
    client_keepalive_options,
    server_keepalive_options,
    service_config_json,
)

__all__ = ["TlsConfig", "client_channel_options", "open_channel"]


def client_channel_options() -> list[tuple[str, int | str]]:
    """Options of the channels the loraswap clients open: keepalive and the service config.

    The receive limit stays at gRPC's default 4 MiB: a loraswap server sends images in pieces of at most
    1 MiB and never sends a message over 4 MiB.
    """
    return [
        *client_keepalive_options(),
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
