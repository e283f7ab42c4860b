"""Adapter names: the grammar written in the proto, checked before anything touches the disk or the network.

local-name = segment *("/" segment)       (under --adapter-dir)
hub-ref    = ["hf:"] owner "/" repo ["@" revision] [":" weight-file]
url-name   = "https://" host [":" port] path ["?" query] ["#sha256=" 64HEXDIG]   (url_names.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraswap.adapter_urls import url_identity
from loraswap.server.engine.adapters.sources.url_names import is_url_name, parse_url_name
from loraswap.server.engine.errors import AdapterNameError, shorten

_SEGMENT = r"[A-Za-z0-9._-]+"
_LOCAL_NAME = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
_HUB_REF = re.compile(
    rf"(?:hf:)?(?P<repo>{_SEGMENT}/{_SEGMENT})(?:@(?P<revision>[A-Za-z0-9._/-]+?))?(?::(?P<weight>{_SEGMENT}(?:/{_SEGMENT})*))?"
)
MAX_NAME_LENGTH = 512
# A segment becomes a file or folder name (plus ".safetensors"); filesystems stop at 255 bytes.
MAX_SEGMENT_LENGTH = 200


@dataclass(frozen=True)
class HubRef:
    """A parsed hub-ref."""

    repo_id: str
    revision: str | None
    weight_name: str | None


def split_names(text: str) -> tuple[str, ...]:
    """Comma-separated adapter names (the `lora` metadata, --pin, --preload). A ',' inside a URL's query does not
    split it: once a URL with a query (other than an identity's digest) is open, every later piece that is not a URL
    of its own belongs to it, so no piece of a query is ever taken, and echoed, as a name. (In such a list, a URL
    with commas in its query comes after the other names, or writes them %2C.)"""
    names: list[str] = []
    for piece in (piece.strip() for piece in text.split(",")):
        if not piece:
            continue
        if names and _takes_more_query(names[-1]) and not is_url_name(piece):
            names[-1] += "," + piece
        else:
            names.append(piece)
    return tuple(names)


def _takes_more_query(name: str) -> bool:
    """A URL whose query may go on past a ',': one with a query that is not an identity's bare digest."""
    if not is_url_name(name) or "?" not in name:
        return False
    query = name.split("#", 1)[0].split("?", 1)[1]
    return url_identity(f"https://h/?{query}") != f"https://h/?{query}"


def is_local_name(name: str) -> bool:
    """Whether `name` has the shape of a local-name (a path of segments under the adapter directory)."""
    return _LOCAL_NAME.fullmatch(name) is not None


def parse_hub_ref(name: str) -> HubRef | None:
    """Parse `[hf:]owner/repo[@revision][:weight-file]`, or None if it is not one."""
    match = _HUB_REF.fullmatch(name)
    if match is None:
        return None
    return HubRef(match["repo"], match["revision"], match["weight"])


def _has_bad_segment(path: str) -> bool:
    return any(segment in ("", ".", "..") for segment in path.split("/"))


def check_name(name: str) -> None:
    """Refuse names that break the grammar before anything touches the disk or the network."""
    if not name:
        raise AdapterNameError("the adapter name is empty; leave `adapter` unset for the base model")
    if is_url_name(name):
        parse_url_name(name)
        return
    if len(name) > MAX_NAME_LENGTH:
        raise AdapterNameError(
            f"the adapter name is {len(name)} characters long; names are limited to {MAX_NAME_LENGTH}"
        )
    longest = max(re.split(r"[/:@]", name), key=len)
    if len(longest) > MAX_SEGMENT_LENGTH:
        raise AdapterNameError(
            f"the adapter name has a part of {len(longest)} characters ({shorten(longest, 40)!r}); each part "
            f"between '/' is limited to {MAX_SEGMENT_LENGTH} characters"
        )
    if name.startswith("/") or "\\" in name:
        raise AdapterNameError(
            f"adapter name {shorten(name)!r} is an absolute path; name adapters relative to the server's adapter "
            "directory"
        )
    ref = parse_hub_ref(name)
    is_local = not name.startswith("hf:") and is_local_name(name)
    if not is_local and ref is None:
        raise AdapterNameError(
            f"adapter name {shorten(name)!r} is not valid: use letters, digits, '.', '_', '-' and '/' "
            "(or hf:owner/repo[@revision][:file.safetensors] for the Hub, or an https:// URL)"
        )
    parts = [name] if is_local else [ref.repo_id, ref.revision or "main", ref.weight_name or "x"]
    if any(_has_bad_segment(part) for part in parts):
        raise AdapterNameError(
            f"adapter name {shorten(name)!r} has an empty, '.' or '..' segment; names cannot leave the adapter "
            "directory or the Hub repository"
        )
