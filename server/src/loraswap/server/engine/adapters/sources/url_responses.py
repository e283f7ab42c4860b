"""What a URL adapter's HTTP response says: where it redirects, whether its status and encoding bring the file (or
which EngineError tells the caller why not), its announced length, and the validators kept for revalidation.

Responses are httpcore's: a status and raw byte pairs of headers.
"""

from __future__ import annotations

import email.utils
import time

from loraswap.server.engine.adapters.sources.url_names import UrlName
from loraswap.server.engine.adapters.sources.url_policy import UrlPolicy
from loraswap.server.engine.errors import ErrorReason, UrlFetchError, UrlMissingError, UrlUnavailableError

# A Retry-After beyond this is read as this: a client is told to come back within the hour at most.
MAX_RETRY_AFTER_S = 3600.0
REDIRECT_STATUSES = (301, 302, 303, 307, 308)


def header(response, name: str) -> str | None:
    """A response header's value (httpcore gives raw byte pairs), or None."""
    wanted = name.lower().encode()
    for key, value in response.headers:
        if key.lower() == wanted:
            return value.decode("latin-1")
    return None


def redirect_location(response) -> str | None:
    """Where a redirect sends the client, or None for a response that is no redirect (or one to nowhere)."""
    location = header(response, "location")
    return location if response.status in REDIRECT_STATUSES and location else None


def validator(response, name: str) -> str | None:
    """An ETag or Last-Modified to send back on revalidation: visible ASCII only (None for any other)."""
    value = header(response, name)
    if value is None or not value or not all("\x20" <= character <= "\x7e" for character in value):
        return None
    return value


def content_length(response) -> int | None:
    """The body's length as the response announces it, or None (not announced, chunked, or not a number)."""
    value = header(response, "content-length")
    if value is None or "chunked" in (header(response, "transfer-encoding") or "").lower():
        return None
    try:
        return int(value)
    except ValueError:
        return None


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header (seconds or an HTTP date) in seconds from now, or None."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)


def check_status(response, final: UrlName, policy: UrlPolicy) -> None:
    """Refuse a response from `final` that is not 200 with the file, saying what to do (the policy tells whether
    the server sent a token that was refused, or had none to send)."""
    status = response.status
    if status == 200:
        return
    shown = f"{final.origin}{final.path}"
    retry_after = retry_after_s(header(response, "retry-after"))
    retry = {} if retry_after is None else {"retry_after_s": f"{retry_after:g}"}
    if status in (401, 403):
        has_token = policy.token_for(final.host) is not None
        hint = (
            "the server's token for this host (--url-token-file) was refused"
            if has_token
            else "give the server a token for this host (--url-token-file), or send a presigned link that has "
            "not expired"
        )
        raise UrlFetchError(
            f"{shown} answered HTTP {status}: {hint}", reason=ErrorReason.URL_ACCESS_DENIED, http_status=status
        )
    if status == 404:
        raise UrlMissingError(
            f"{shown} answered HTTP 404: no file there; check the URL", reason=ErrorReason.URL_NOT_FOUND
        )
    if status == 410:
        raise UrlMissingError(
            f"{shown} answered HTTP 410: the file was removed for good; use another URL",
            reason=ErrorReason.URL_GONE,
        )
    if status == 429:
        raise UrlUnavailableError(
            f"{final.origin} answered HTTP 429 (too many requests); retry after a pause",
            reason=ErrorReason.URL_RATE_LIMITED,
            **retry,
        )
    if 500 <= status <= 599:
        raise UrlUnavailableError(
            f"{final.origin} answered HTTP {status} (a server error); retry later",
            reason=ErrorReason.URL_SERVER_ERROR,
            http_status=status,
            **retry,
        )
    raise UrlFetchError(
        f"{shown} answered HTTP {status}, not 200 with the file; check the URL",
        reason=ErrorReason.URL_HTTP_ERROR,
        http_status=status,
    )


def check_encoding(response, final: UrlName) -> None:
    """Refuse a body sent with a Content-Encoding: the server asks for the file's own bytes and decompresses
    nothing."""
    encoding = (header(response, "content-encoding") or "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UrlFetchError(
            f"{final.origin}{final.path} sent the adapter with Content-Encoding {encoding[:20]!r}; the "
            "server asks for and accepts only the file's own bytes (no compression): serve it unencoded",
            reason=ErrorReason.URL_CONTENT_ENCODING_REFUSED,
        )
