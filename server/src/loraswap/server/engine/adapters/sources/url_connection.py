"""The connection under a URL adapter's download: made to the address the policy checked, shut at the deadline, and
what it means when it fails before the host answers.

HTTP is httpcore's (the transport under httpx) with a network backend of our own: it connects to the address
checked rather than resolving the name again, and it can shut the download's sockets from another thread (the
fetch's watchdog, at the deadline), so that a host trickling its headers or body is cut then, whatever it sends in
between.
"""

from __future__ import annotations

import logging
import ssl
import threading

from loraswap.server.engine.adapters.sources.url_names import UrlName
from loraswap.server.engine.errors import EngineError, ErrorReason, UrlFetchError, UrlUnavailableError

# httpx logs every request's URL at INFO, query string and all; a presigned URL's signature must never be logged.
for _chatty in ("httpx", "httpcore"):
    logging.getLogger(_chatty).setLevel(logging.WARNING)


class CheckedAddressBackend:
    """httpcore's socket backend, connecting to the address the policy checked (the URL's name still gives SNI, the
    certificate's name and Host), and recording its sockets so that `abort` can shut them from another thread."""

    def __init__(self) -> None:
        import httpcore

        self._inner = httpcore.SyncBackend()
        self._lock = threading.Lock()
        self._sockets: list = []
        self.address = ""
        self.aborted = False

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = self._inner.connect_tcp(self.address, port, timeout, local_address, socket_options)
        # A duplicate of the descriptor: TLS detaches the socket object it wraps, but shutting any descriptor of a
        # connection ends it (a handshake or read under way fails at once).
        handle = stream.get_extra_info("socket").dup()
        with self._lock:
            self._sockets.append(handle)
            if self.aborted:
                _shut(handle)
        return stream

    def connect_unix_socket(self, path, timeout=None, socket_options=None):  # pragma: no cover - never asked for
        raise OSError("no unix sockets for adapter URLs")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)

    def abort(self) -> None:
        """Shut every connection of this download: a handshake or read under way fails at once."""
        with self._lock:
            self.aborted = True
            for handle in self._sockets:
                _shut(handle)

    def close(self) -> None:
        """Close the duplicates (the download is over; its connections are httpcore's to close)."""
        with self._lock:
            for handle in self._sockets:
                handle.close()
            self._sockets.clear()


def _shut(sock) -> None:
    import socket

    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def has_ssl_cause(error: BaseException) -> bool:
    """Whether `error`, or what caused it (a few links down), is an ssl.SSLError: a TLS failure, not the network's."""
    seen = error
    for _ in range(8):
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            return False
    return False


def connection_error(error: BaseException, current: UrlName, io_s: float) -> EngineError:
    """What a request to `current` that failed before its host answered means, for the caller: TLS, a timeout
    (`io_s`), a refused connection, a header httpcore would not write, or a connection that broke."""
    import httpcore

    if has_ssl_cause(error):
        return UrlFetchError(
            f"the TLS handshake with {current.origin} failed (its certificate is not trusted or not for that "
            "name); the server verifies against the system's CAs or --url-ca-file",
            reason=ErrorReason.URL_TLS_FAILED,
        )
    shown = f"{current.origin}{current.path}"
    # error kind (the first that `error` is, in this order), what to raise, why, and the message
    failures: tuple[tuple[type[BaseException], type[EngineError], ErrorReason, str], ...] = (
        (httpcore.TimeoutException, UrlUnavailableError, ErrorReason.URL_TIMED_OUT,
         (f"{current.origin} did not answer within {io_s:g} s (--url-timeout-seconds); retry later, or check that "
          "the host is up")),
        (httpcore.ConnectError, UrlUnavailableError, ErrorReason.URL_CONNECT_FAILED,
         (f"could not connect to {current.origin} for {shown} (refused or unreachable); retry later, or check the "
          "host and port")),
        (httpcore.LocalProtocolError, UrlFetchError, ErrorReason.URL_HTTP_ERROR,
         (f"the request to {current.origin} could not be written (a header the server was given, such as its "
          "--url-token-file token, is not valid HTTP)")),
        (BaseException, UrlUnavailableError, ErrorReason.URL_CONNECT_FAILED,
         f"the connection to {current.origin} broke before it answered ({type(error).__name__}); retry later"),
    )  # fmt: skip
    error_class, reason, message = next(
        (cls, why, text) for kind, cls, why, text in failures if isinstance(error, kind)
    )
    return error_class(message, reason=reason)
