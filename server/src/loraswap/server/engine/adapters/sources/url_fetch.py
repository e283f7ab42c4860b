"""Adapters from https:// URLs: checked, streamed to the disk cache, then read like any local file.

When a URL adapter is not in the host cache, the loader thread asks `UrlAdapterSource.fetch` for a local file:

1. The policy (url_policy.py) allows the host and scheme, or the request is refused before anything is sent.
2. A name that pins `#sha256=` whose file is on disk is served from it: no request at all.
3. An identity fetched before (a record in the disk cache) is revalidated: a conditional GET (If-None-Match,
   If-Modified-Since); 304 serves the file on disk, 200 downloads anew. A file the host cache holds is never
   revalidated while it stays there, as a local file is not re-read.
4. Otherwise the body is streamed to a partial file with its SHA-256: never whole in memory, --max-adapter-bytes
   checked against Content-Length and again while streaming, a read timeout on every read and a deadline on the
   whole download, Accept-Encoding identity (a Content-Encoding is refused: no decompression), redirects followed
   by hand (at most MAX_REDIRECTS, each target checked like the first URL, tokens only to their own host), no
   cookies kept, a new connection for every request, made to the address the policy checked. The
   finished file must hash to the name's `#sha256=` if it has one and begin like a safetensors file; then it is
   renamed into the disk cache and its record written.

Every failure leaves nothing behind and raises an EngineError whose message names the URL's identity only.

The connection under every request (made to the checked address, shut at the deadline) is url_connection.py's;
what a response's status and headers mean is url_responses.py's.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.download_cache import DownloadCache, UrlRecord
from loraswap.server.engine.adapters.sources.safetensors_file import has_safetensors_header
from loraswap.server.engine.adapters.sources.url_connection import (
    CheckedAddressBackend,
    connection_error,
    has_ssl_cause,
)
from loraswap.server.engine.adapters.sources.url_names import UrlName, parse_url_name
from loraswap.server.engine.adapters.sources.url_policy import UrlPolicy
from loraswap.server.engine.adapters.sources.url_responses import (
    check_encoding,
    check_status,
    content_length,
    redirect_location,
    validator,
)
from loraswap.server.engine.errors import (
    AdapterNameError,
    AdapterTooLargeError,
    EngineError,
    ErrorReason,
    NotServingError,
    UrlFetchError,
    UrlRefusedError,
    UrlUnavailableError,
)
from loraswap.server.engine.observer import NO_OBSERVER, EngineObserver

log = logging.getLogger(__name__)

MAX_REDIRECTS = 5


@dataclass(frozen=True)
class UrlTimeouts:
    """Seconds: to connect and for each read (`io_s`), and for the whole download (`deadline_s`)."""

    io_s: float = 30.0
    deadline_s: float = 600.0


@dataclass
class DownloadProgress:
    """A download under way: bytes written so far, and the total the server announced (0: not announced)."""

    done: int = 0
    total: int = 0


class UrlAdapterSource:
    """Fetches URL adapters into a DownloadCache under a UrlPolicy; one download per identity at a time."""

    def __init__(
        self,
        policy: UrlPolicy,
        cache: DownloadCache,
        *,
        max_adapter_bytes: int = 0,
        ca_file: Path | None = None,
        timeouts: UrlTimeouts = UrlTimeouts(),
        observer: EngineObserver = NO_OBSERVER,
    ) -> None:
        self.policy = policy
        self.cache = cache
        self.max_adapter_bytes = max_adapter_bytes
        self.timeouts = timeouts
        self.observer = observer
        self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        self._lock = threading.Lock()
        self._progress: dict[str, DownloadProgress] = {}
        self._downloads: set[CheckedAddressBackend] = set()
        self._stopping = threading.Event()

    def close(self) -> None:
        """Stop: downloads under way end now (their sockets shut), and no new one starts."""
        self._stopping.set()
        with self._lock:
            downloads = list(self._downloads)
        for backend in downloads:
            backend.abort()

    def progress(self, identity: str) -> DownloadProgress | None:
        """The download of `identity` under way now, or None."""
        with self._lock:
            return self._progress.get(identity)

    def fetch(self, url: UrlName) -> AdapterFile:
        """A local file holding the adapter `url` names, downloaded if need be (on a loader thread)."""
        label = self.policy.check(url)
        started = time.perf_counter()
        if url.sha256 and self.cache.claim(url.sha256):
            self.observer.url_download(label, "disk", 0)
            return self._file(url, url.sha256, 0.0, 0)
        progress = DownloadProgress()
        backend = CheckedAddressBackend()
        watchdog = threading.Timer(self.timeouts.deadline_s, backend.abort)
        watchdog.daemon = True
        with self._lock:
            self._progress[url.identity] = progress
            self._downloads.add(backend)
        try:
            watchdog.start()
            if self._stopping.is_set():
                raise _stopping()
            sha256, transferred, outcome = self._download(url, progress, backend)
        except EngineError as error:
            self.observer.url_download(label, str(error.reason), progress.done)
            raise
        finally:
            watchdog.cancel()
            with self._lock:
                self._progress.pop(url.identity, None)
                self._downloads.discard(backend)
            backend.close()
        self.observer.url_download(label, outcome, transferred)
        return self._file(url, sha256, (time.perf_counter() - started) * 1000.0, transferred)

    def _file(self, url: UrlName, sha256: str, download_ms: float, download_bytes: int) -> AdapterFile:
        return AdapterFile(
            name=url.identity,
            path=self.cache.path_of(sha256),
            source=f"{url.origin}{url.path} sha256:{sha256}",
            max_bytes=self.max_adapter_bytes,
            sha256=sha256,
            download_ms=download_ms,
            download_bytes=download_bytes,
        )

    def discard(self, url: UrlName, sha256: str) -> None:
        """Forget a download whose bytes are no usable adapter, so that nothing of it stays cached."""
        self.cache.forget(url.identity)
        self.cache.discard(sha256)

    # -- the download --------------------------------------------------------------------------------------------

    def _download(self, url: UrlName, progress: DownloadProgress, backend) -> tuple[str, int, str]:
        """(sha256, bytes transferred, outcome): "not_modified" (the file on disk still current) or "downloaded"."""
        record = self.cache.record(url.identity)
        conditional = {}
        if record is not None and url.sha256 in (None, record.sha256):
            if record.etag:
                conditional["If-None-Match"] = record.etag
            if record.last_modified:
                conditional["If-Modified-Since"] = record.last_modified
        # A 304 serves the file on disk, unless it went (to make room for another download) since the record was
        # read: then once more, unconditionally.
        for attempt in (conditional, {}) if conditional else ({},):
            with self._response(url, attempt, backend) as (response, final):
                if response.status == 304 and attempt:
                    if self.cache.claim(record.sha256):
                        return record.sha256, 0, "not_modified"
                    continue
                check_status(response, final, self.policy)
                check_encoding(response, final)
                announced = content_length(response)
                self._check_size(url, announced)
                progress.total = announced or 0
                with self.cache.room(announced or 0):
                    sha256 = self._stream(url, response, progress, announced, backend)
                break
        record = UrlRecord(
            identity=url.identity,
            sha256=sha256,
            bytes=progress.done,
            etag=validator(response, "etag"),
            last_modified=validator(response, "last-modified"),
            fetched_unix=time.time(),
        )
        try:
            self.cache.write_record(record)
        except OSError as error:  # the file is whole and usable; only the next revalidation is lost
            log.warning("could not record %s in the disk cache (%s); it downloads again next time", url.identity,
                        error.strerror)  # fmt: skip
        return sha256, progress.done, "downloaded"

    @contextmanager
    def _response(self, url: UrlName, conditional: dict[str, str], backend) -> Iterator[tuple[object, UrlName]]:
        """The streamed response at the end of the redirects, and the URL it came from."""
        current = url
        for hop in range(MAX_REDIRECTS + 1):
            headers = [
                ("Accept-Encoding", "identity"),
                ("User-Agent", "loraswap"),
                ("Host", current.origin.split("://", 1)[1]),
            ]
            if current.host == url.host:
                headers += list(conditional.items())
            token = self.policy.token_for(current.host)
            if token is not None:
                headers.append(("Authorization", f"Bearer {token}"))
            with self._send(current, headers, backend) as response:
                location = redirect_location(response)
                if location is None:
                    yield response, current
                    return
            if hop == MAX_REDIRECTS:
                break
            current = self._redirect_target(current, current.link, location)
        raise UrlFetchError(
            f"{url.origin}{url.path} redirected more than {MAX_REDIRECTS} times (a loop?); give the URL the "
            "redirects end at",
            reason=ErrorReason.URL_TOO_MANY_REDIRECTS,
        )

    @contextmanager
    def _send(self, current: UrlName, headers, backend):
        """One GET of `current` on a new connection to each of its checked addresses in turn, until one connects."""
        import httpcore

        timeout = self.timeouts.io_s
        extensions = {"timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}}
        addresses = self.policy.addresses_for(current, self.timeouts.io_s)
        for index, address in enumerate(addresses):
            backend.address = address
            opened = ExitStack()
            try:
                pool = opened.enter_context(
                    httpcore.ConnectionPool(
                        ssl_context=self._ssl, max_keepalive_connections=0, network_backend=backend, retries=0
                    )
                )
                response = opened.enter_context(
                    pool.stream("GET", current.link, headers=headers, extensions=extensions)
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                opened.close()
                fatal = has_ssl_cause(error) or backend.aborted or index == len(addresses) - 1
                if fatal:
                    raise self._transport_error(error, current, backend) from None
                continue  # the next address the name resolved to
            except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError, ssl.SSLError) as error:
                opened.close()
                raise self._transport_error(error, current, backend) from None
            except (ValueError, UnicodeError, TypeError):  # httpcore refusing the request as written
                opened.close()
                raise UrlFetchError(
                    f"the request to {current.origin}{current.path} could not be written; check the URL",
                    reason=ErrorReason.URL_HTTP_ERROR,
                ) from None
            with opened:  # outside the handlers above: what the caller's block raises passes through unchanged
                yield response
            return

    def _cut_short(self, url: UrlName, backend) -> EngineError | None:
        """What cut the download short when it was the stop or the deadline, not the host; None otherwise."""
        if self._stopping.is_set():
            return _stopping()
        if backend.aborted:
            return _timed_out(url, self.timeouts.deadline_s)
        return None

    def _check_not_cut(self, url: UrlName, backend) -> None:
        """Raise what cut the download short when it was the stop or the deadline, not the host."""
        cut = self._cut_short(url, backend)
        if cut is not None:
            raise cut

    def _transport_error(self, error: BaseException, current: UrlName, backend) -> EngineError:
        cut = self._cut_short(current, backend)
        return cut if cut is not None else connection_error(error, current, self.timeouts.io_s)

    def _redirect_target(self, current: UrlName, link: str, location: str) -> UrlName:
        try:
            target = parse_url_name(urljoin(link, location))
        except AdapterNameError as error:
            raise UrlRefusedError(
                f"{current.origin}{current.path} redirected to a URL the server does not follow ({error.message})",
                reason=ErrorReason.URL_REDIRECT_REFUSED,
            ) from None
        if current.scheme == "https" and target.scheme != "https":
            raise UrlRefusedError(
                f"{current.origin}{current.path} redirected to plain http:// ({target.origin}); redirects must "
                "stay on HTTPS",
                reason=ErrorReason.URL_REDIRECT_REFUSED,
                host=target.host,
            )
        self.policy.check(target, redirected_from=f"{current.origin}{current.path}")
        return target

    def _check_size(self, url: UrlName, size: int | None, *, so_far: bool = False) -> None:
        limit = self.max_adapter_bytes
        if limit and size is not None and size > limit:
            how_big = f"sent more than {limit} bytes and was cut off" if so_far else f"is {size} bytes"
            raise AdapterTooLargeError(
                f"{url.origin}{url.path} {how_big}, over the server's limit of {limit} (--max-adapter-bytes); "
                "use a smaller rank or fewer layers",
                file_bytes=size,
                max_bytes=limit,
            )

    def _stream(self, url: UrlName, response, progress: DownloadProgress, announced: int | None, backend) -> str:
        """Write the body to a partial file and commit it; its sha256."""
        import httpcore

        shown = f"{url.origin}{url.path}"
        digest = hashlib.sha256()
        with self.cache.partial_file() as (partial, handle):
            try:
                for chunk in response.iter_stream():  # each read as it comes
                    digest.update(chunk)
                    handle.write(chunk)
                    progress.done += len(chunk)
                    self._check_size(url, progress.done, so_far=True)
            except httpcore.TimeoutException:
                self._check_not_cut(url, backend)
                raise UrlUnavailableError(
                    f"{shown} stopped sending after {progress.done} bytes (nothing for {self.timeouts.io_s:g} s, "
                    "--url-timeout-seconds); retry later",
                    reason=ErrorReason.URL_TIMED_OUT,
                ) from None
            except (httpcore.NetworkError, httpcore.ProtocolError):
                self._check_not_cut(url, backend)
                raise _short(url, progress.done, announced) from None
            # A body with no length of its own ends when the connection does, and so ends one the watchdog shut.
            self._check_not_cut(url, backend)
            if announced is not None and progress.done < announced:
                raise _short(url, progress.done, announced)
            if not announced:
                self.cache.make_room(progress.done)
            sha256 = digest.hexdigest()
            if url.sha256 and sha256 != url.sha256:
                raise UrlFetchError(
                    f"{shown} gave {progress.done} bytes whose SHA-256 is {sha256}, not the {url.sha256} the name pins "
                    "(#sha256=); the file changed: pin its new hash or fix the URL",
                    reason=ErrorReason.URL_CHECKSUM_MISMATCH,
                    sha256=sha256,
                )
            handle.flush()
            if not has_safetensors_header(partial):
                raise UrlFetchError(
                    f"{shown} gave {progress.done} bytes that are not a safetensors file (an error page, or another "
                    "format?); loraswap reads safetensors only",
                    reason=ErrorReason.URL_NOT_SAFETENSORS,
                )
            self.cache.commit(partial, handle, sha256)
        return sha256


def _stopping() -> NotServingError:
    return NotServingError(
        "the server is stopping and ended the adapter download; retry on another replica",
        reason=ErrorReason.SHUTTING_DOWN,
    )


def _timed_out(url: UrlName, deadline_s: float) -> UrlUnavailableError:
    return UrlUnavailableError(
        f"downloading {url.origin}{url.path} took longer than {deadline_s:g} s (--url-deadline-seconds); retry "
        "later, or serve it from a faster host",
        reason=ErrorReason.URL_TIMED_OUT,
    )


def _short(url: UrlName, received: int, announced: int | None) -> UrlUnavailableError:
    expected = f" of the {announced} its Content-Length announced" if announced else ""
    return UrlUnavailableError(
        f"{url.origin}{url.path} ended the body after {received} bytes{expected}; retry",
        reason=ErrorReason.URL_BODY_SHORT,
    )
