"""Adapter names that are URLs: their grammar, and the public identity that stands for them everywhere.

    url-name = ("https" / "http") "://" host [":" port] path ["?" query] ["#sha256=" 64HEXDIG]

A presigned object-store link carries its signature in the query string, and a model site's link may carry
a token there: the query is a secret. So the full URL (the *link*) goes only to the fetcher, and everything
else (the caches, Image.adapter, ListAdapters, errors, logs, metrics, traces) sees the URL's *identity*:

    scheme "://" host [":" port] path ["?" 12HEXDIG] ["#sha256=" 64HEXDIG]

The query is left out, save for a digest of the parameters that are not signing or credential parameters
(loraswap.adapter_urls.SIGNING_PARAMETERS; clients write the identity too, for the `lora` metadata): the links a
store signs anew for each request name one identity, while a model site's `?format=SafeTensor&type=Model` stays
apart from its `?format=PickleTensor`. An identity given as a name is its own identity (a bare 12-hex query is read
as a digest already made), so ListAdapters' ids work in Evict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from loraswap.adapter_urls import URL_DEFAULT_PORTS, url_identity
from loraswap.server.engine.errors import AdapterNameError, ErrorReason, shorten

URL_SCHEMES = ("https", "http")
# A presigned link with a session token runs to some 2 KB; the rest is room.
MAX_URL_NAME_LENGTH = 8192
_SHA256_FRAGMENT = re.compile(r"sha256=([0-9a-fA-F]{64})")
_HOST = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_FORBIDDEN = re.compile(r"[^\x21-\x7e]|\\")  # all but visible ASCII, and backslashes


@dataclass(frozen=True)
class UrlName:
    """A parsed url-name: its public identity, and the link to fetch (a secret: never shown, never logged)."""

    identity: str
    link: str = field(repr=False, compare=False)
    origin: str  # scheme://host[:port], as the identity shows it
    scheme: str
    host: str  # lower case; an IPv6 address without its brackets
    port: int
    path: str
    sha256: str | None  # the `#sha256=` the name pins, lower case


MAX_HOST_LENGTH = 253
MAX_LABEL_LENGTH = 63


def _is_ipv6(text: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def is_url_name(name: str) -> bool:
    """Whether a name is meant as a URL (it has a scheme); local names and hub-refs never hold "://"."""
    return "://" in name


def _refuse(message: str, reason: ErrorReason = ErrorReason.INVALID_ADAPTER_NAME) -> AdapterNameError:
    return AdapterNameError(message, reason=reason)


def parse_url_name(name: str) -> UrlName:
    """A url-name parsed, or AdapterNameError saying what to fix. No message ever quotes the query."""
    scheme, _, rest = name.partition("://")
    scheme = scheme.lower()
    if scheme not in URL_SCHEMES:
        raise _refuse(
            f"adapter URLs are https:// (or http:// for hosts the server allows insecurely), not "
            f"{shorten(scheme, 20)!r}://; serve the file over HTTPS",
            ErrorReason.URL_SCHEME_UNSUPPORTED,
        )
    if len(name) > MAX_URL_NAME_LENGTH:
        raise _refuse(f"the adapter URL is {len(name)} characters long; URLs are limited to {MAX_URL_NAME_LENGTH}")
    if _FORBIDDEN.search(name):
        raise _refuse(
            "the adapter URL holds a space, a backslash, a control or a non-ASCII character; percent-encode it"
        )
    try:
        parts = urlsplit(scheme + "://" + rest)
        parts.port  # noqa: B018 - ValueError for a port that is not one
    except ValueError:
        raise _refuse(
            f"the adapter URL for {scheme}:// has a malformed host or port (brackets, a port out of range)"
        ) from None
    shown_at = f"{scheme}://{shorten(parts.netloc.rpartition('@')[2], 80)}"
    if "@" in parts.netloc:
        raise _refuse(
            f"the adapter URL for {shown_at} carries credentials before its host (user:password@); the server "
            "never sends those: give the server a token for the host (--url-token-file) instead",
            ErrorReason.URL_CREDENTIALS_IN_NAME,
        )
    try:
        port = parts.port or URL_DEFAULT_PORTS[scheme]
    except ValueError:
        raise _refuse(f"the adapter URL {shown_at} has an invalid port") from None
    host = (parts.hostname or "").lower()
    if host.startswith("[") or not host:
        raise _refuse(f"the adapter URL {shown_at} names no host")
    bracketed = parts.netloc.rpartition("@")[2].startswith("[")
    if bracketed and not _is_ipv6(host):
        raise _refuse(f"the adapter URL {shown_at} has brackets around something that is no IPv6 address")
    too_long = len(host) > MAX_HOST_LENGTH or any(len(label) > MAX_LABEL_LENGTH for label in host.split("."))
    if not bracketed and (too_long or not _HOST.fullmatch(host)):
        raise _refuse(
            f"the adapter URL's host {shorten(host, 80)!r} is not a host name (letters, digits, '-' and '.', "
            "IDNA-encoded) or an IP address"
        )
    sha256 = None
    if parts.fragment:
        match = _SHA256_FRAGMENT.fullmatch(parts.fragment)
        if match is None:
            raise _refuse(
                f"the adapter URL for {shown_at} has a fragment other than #sha256=<64 hex digits>; the fragment "
                "may only pin the file's SHA-256"
            )
        sha256 = match.group(1).lower()
    path = parts.path or "/"
    identity = url_identity(name)
    origin = identity[: identity.index("/", len(scheme) + 3)]  # the identity's scheme://host[:port], up to its path
    link = name.split("#", 1)[0]
    return UrlName(
        identity=identity, link=link, origin=origin, scheme=scheme, host=host, port=port, path=path, sha256=sha256
    )


def public_name(name: str) -> str:
    """The name callers and logs may see: a URL's identity, any other name itself. AdapterNameError for a URL that
    breaks the grammar (its message never quotes the query)."""
    return parse_url_name(name).identity if is_url_name(name) else name


def loggable_name(name: str) -> str:
    """public_name for a log line or metric: never raises; a malformed URL is "<invalid URL>"."""
    try:
        return public_name(name)
    except Exception:  # noqa: BLE001 - whatever a hostile name makes the parser raise, a log line gets no part of it
        return "<invalid URL>"
