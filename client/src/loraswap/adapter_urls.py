"""The identity of an adapter URL, which clients and servers must agree on: written once, here.

A URL adapter (the url-name of the proto's grammar) is known by an identity that leaves its query out, for the
query of a presigned link or a model site's download is a secret (its signature, a token):

    scheme "://" host [":" port] path ["?" 12HEXDIG] ["#sha256=" 64HEXDIG]

The 12 hex digits digest the query's parameters that neither sign nor authorise the link, so links to one
object signed anew each time are one identity. Clients send it as the `lora` metadata (proxies hash and log
that header), and servers key their caches, replies and logs by it. Plain standard library: the server's engine
imports this, and neither side imports the other.
"""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl, urlencode, urlsplit

__all__ = ["QUERY_DIGEST_HEX", "SIGNING_PARAMETERS", "SIGNING_PREFIXES", "URL_DEFAULT_PORTS", "url_identity"]

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
