"""TLS (and mTLS) server credentials whose certificate, key and client CA are re-read on request (SIGHUP).

gRPC's dynamic SSL credentials ask a fetcher for a new certificate configuration at each new connection's
handshake; `reload` reads and checks the files and hands the result to that fetcher, so new connections
get the new certificate while connections already open, and their calls in flight, keep theirs.
"""

from __future__ import annotations

import ssl
import threading
from pathlib import Path

import grpc

from loraswap.server.config import SettingsError


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise SettingsError(f"cannot read {flag} {path}: {error.strerror or error}") from None


def _check_certificate_and_key(certificate: Path, key: Path) -> None:
    """Refuse files that are not a PEM certificate chain and its own unencrypted private key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # The password callback refuses encrypted keys instead of prompting on the terminal.
        context.load_cert_chain(certificate, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as error:
        raise SettingsError(
            f"--tls-cert {certificate} and --tls-key {key} are not a PEM certificate chain and its unencrypted "
            f"private key ({getattr(error, 'reason', None) or error})"
        ) from None


def _check_ca_bundle(bundle: bytes, path: Path) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=bundle.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as error:
        raise SettingsError(f"--tls-client-ca {path} is not a bundle of PEM CA certificates ({error})") from None


class ReloadableServerCredentials:
    """Server credentials for --tls-cert/--tls-key (and --tls-client-ca, which makes client certificates required)."""

    def __init__(self, certificate: Path, key: Path, client_ca: Path | None = None) -> None:
        """Reads and checks the files now.

        Raises:
            SettingsError: a file is unreadable, or the certificate and key do not make a usable pair.
        """
        self.certificate, self.key, self.client_ca = certificate, key, client_ca
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._read_configuration(),
            self._next_configuration,
            require_client_authentication=client_ca is not None,
        )

    def reload(self) -> None:
        """Re-reads the files; connections made from now on use them. Nothing changes when they are unusable.

        Raises:
            SettingsError: a file is unreadable or the pair unusable (the files read before stay in use).
        """
        configuration = self._read_configuration()
        with self._lock:
            self._pending = configuration

    def _next_configuration(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC on its own threads, at every handshake: None keeps the configuration in use.
        with self._lock:
            configuration, self._pending = self._pending, None
        return configuration

    def _read_configuration(self) -> grpc.ServerCertificateConfiguration:
        pair = (_read(self.certificate, "--tls-cert"), _read(self.key, "--tls-key"))
        _check_certificate_and_key(self.certificate, self.key)
        if (_read(self.certificate, "--tls-cert"), _read(self.key, "--tls-key")) != pair:
            # Checked files must be the ones served; a rotation caught half-written is retried by the next SIGHUP.
            raise SettingsError(f"--tls-cert {self.certificate} or --tls-key {self.key} changed while being read")
        client_ca = None
        if self.client_ca is not None:
            client_ca = _read(self.client_ca, "--tls-client-ca")
            _check_ca_bundle(client_ca, self.client_ca)
        certificate_chain, private_key = pair
        return grpc.ssl_server_certificate_configuration(
            [(private_key, certificate_chain)], root_certificates=client_ca
        )
