"""Where adapter files come from: the adapter directory, the Hugging Face Hub, or an https:// URL.

A source only turns a name into a local safetensors file; it never reads the
weights. Names follow the grammar written in the proto:

    local-name = segment *("/" segment)       (under --adapter-dir)
    hub-ref    = ["hf:"] owner "/" repo ["@" revision] [":" weight-file]
    url-name   = "https://" host [":" port] path ["?" query] ["#sha256=" 64HEXDIG]   (url_names.py)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraswap.adapter_urls import url_identity
from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.url_names import is_url_name, parse_url_name
from loraswap.server.engine.adapters.sources.url_policy import UrlPolicy
from loraswap.server.engine.errors import (
    AdapterFormatError,
    AdapterNameError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    EngineError,
    ErrorReason,
    HubDisabledError,
    shorten,
)

if TYPE_CHECKING:
    from loraswap.server.engine.adapters.sources.url_fetch import DownloadProgress, UrlAdapterSource

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# A Hugging Face model card; its YAML front matter may declare the adapter's base model.
MODEL_CARD_NAME = "README.md"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
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
    is_local = not name.startswith("hf:") and _LOCAL_NAME.fullmatch(name) is not None
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


def _check_size(path: Path, max_bytes: int) -> None:
    size = path.stat().st_size
    if max_bytes and size > max_bytes:
        raise AdapterTooLargeError(
            f"adapter file {shorten(path.name)} is {size} bytes, over the server's limit of {max_bytes} "
            "(--max-adapter-bytes); use a smaller rank or fewer layers",
            file_bytes=size,
            max_bytes=max_bytes,
        )


def pick_weight_file(folder: Path, label: str) -> Path:
    """The adapter file inside a folder: diffusers' standard name, else the only .safetensors."""
    standard = folder / DIFFUSERS_WEIGHT_NAME
    if standard.is_file():
        return standard
    candidates = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        names = shorten(", ".join(p.name for p in candidates))
        raise AdapterFormatError(
            f"{shorten(label)} holds several .safetensors files ({names}); name one of them, "
            f"e.g. {shorten(label)}/{shorten(candidates[0].stem)}"
        )
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterFormatError(
            f"{shorten(label)} holds only pickle files ({shorten(', '.join(pickles))}); loraswap reads safetensors "
            "only, convert the adapter to .safetensors",
            reason=ErrorReason.ADAPTER_PICKLE_REFUSED,
        )
    raise AdapterNotFoundError(f"{shorten(label)} holds no .safetensors file")


class LocalAdapterDirectory:
    """Adapters stored as files or folders under one directory; nothing outside it is reachable."""

    def __init__(self, root: Path | None, max_adapter_bytes: int = 0) -> None:
        self.root = root.resolve() if root is not None else None
        self.max_adapter_bytes = max_adapter_bytes

    def _inside(self, path: Path) -> Path:
        real = path.resolve()
        if self.root is None or not real.is_relative_to(self.root):
            raise AdapterNameError(
                f"{shorten(path.name)} resolves outside the adapter directory (a symlink leaving it?); refused"
            )
        return real

    def find(self, name: str) -> AdapterFile | None:
        """The file for a local name, or None when nothing by that name is here."""
        if self.root is None or not _LOCAL_NAME.fullmatch(name):
            return None
        try:
            return self._find(name)
        # An unreadable folder, a symlink loop (RuntimeError from resolve), ...: say so, without any path.
        except (OSError, RuntimeError) as exc:
            raise AdapterNotFoundError(
                f"adapter {shorten(name)!r} cannot be opened under the adapter directory "
                f"({getattr(exc, 'strerror', None) or type(exc).__name__}); check the name and the file's permissions",
                adapter=name,
            ) from exc

    def _find(self, name: str) -> AdapterFile | None:
        candidate = self.root / name
        pickled = [candidate] if candidate.suffix in PICKLE_SUFFIXES else []
        pickled += [candidate.with_name(candidate.name + suffix) for suffix in PICKLE_SUFFIXES]
        safetensors = candidate.with_name(candidate.name + ".safetensors")
        if not candidate.is_dir() and not safetensors.is_file() and any(p.is_file() for p in pickled):
            raise AdapterFormatError(
                f"adapter {shorten(name)!r} is a pickle file; loraswap reads safetensors only, "
                "convert it to .safetensors",
                reason=ErrorReason.ADAPTER_PICKLE_REFUSED,
            )
        if candidate.is_dir():
            real = pick_weight_file(self._inside(candidate), name)
        elif candidate.is_file():
            real = candidate
        elif safetensors.is_file():
            real = safetensors
        else:
            return None
        real = self._inside(real)
        if real.suffix != ".safetensors":
            raise AdapterFormatError(
                f"adapter {shorten(name)!r} is not a .safetensors file; loraswap reads safetensors only"
            )
        _check_size(real, self.max_adapter_bytes)
        return AdapterFile(
            name=name,
            path=real,
            source=str(real.relative_to(self.root)),
            max_bytes=self.max_adapter_bytes,
            model_card=self._model_card(real.parent),
        )

    def _model_card(self, folder: Path) -> Path | None:
        """The README.md of an adapter's own folder; the directory's root holds many adapters, so none of theirs."""
        card = folder / MODEL_CARD_NAME
        try:
            inside = folder != self.root and card.is_file() and card.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):  # a card that cannot be resolved is no card; the weights still load
            inside = False
        return card if inside else None


class HubAdapterSource:
    """Adapters fetched with huggingface_hub into its normal cache (HF_HUB_OFFLINE=1: cache only)."""

    def __init__(self, allowed: bool, max_adapter_bytes: int = 0) -> None:
        self.allowed = allowed
        self.max_adapter_bytes = max_adapter_bytes

    def fetch(self, name: str, ref: HubRef) -> AdapterFile:
        """Download (or find in the cache) the adapter file for a hub-ref."""
        if not self.allowed:
            raise HubDisabledError(
                f"{shorten(name)!r} is not under the adapter directory and the server runs without --allow-hub; "
                "put the adapter in the adapter directory or start the server with --allow-hub"
            )
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        try:
            if ref.weight_name:
                if not ref.weight_name.endswith(".safetensors"):
                    raise AdapterFormatError(
                        f"{shorten(ref.weight_name)} is not a .safetensors file; loraswap reads safetensors only",
                        reason=ErrorReason.ADAPTER_PICKLE_REFUSED,
                    )
                path = Path(hf_hub_download(ref.repo_id, ref.weight_name, revision=ref.revision))
                card = _hub_model_card(ref)
            else:
                folder = Path(
                    snapshot_download(
                        ref.repo_id, revision=ref.revision, allow_patterns=["*.safetensors", "*.bin", MODEL_CARD_NAME]
                    )
                )
                path = pick_weight_file(folder, name)
                card = folder / MODEL_CARD_NAME
        except HFValidationError as exc:
            raise AdapterNameError(f"{shorten(name)!r} is not a valid Hub reference: {shorten(exc)}") from exc
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError, LocalEntryNotFoundError) as exc:
            raise AdapterNotFoundError(
                f"adapter {shorten(name)!r} was not found on the Hub or in the local Hub cache: {type(exc).__name__}"
            ) from exc
        _check_size(path, self.max_adapter_bytes)
        revision = ref.revision or "main"
        return AdapterFile(
            name=name,
            path=path,
            source=f"hf://{ref.repo_id}@{revision}/{path.name}",
            max_bytes=self.max_adapter_bytes,
            model_card=card if card is not None and card.is_file() else None,
        )


def _hub_model_card(ref: HubRef) -> Path | None:
    """The repo's README.md (one small file, from the Hub cache when it is there), or None."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ref.repo_id, MODEL_CARD_NAME, revision=ref.revision))
    # The card is optional: a repo without one, an offline cache without it or a network error only mean
    # no declaration to check; the weights were found, and that is what the request needs.
    except Exception:  # noqa: BLE001 - huggingface_hub and its HTTP client raise many kinds; all mean "no card"
        return None


class AdapterSources:
    """Resolves an adapter name to a local file: a URL through its fetcher, else the adapter directory first, then
    the Hub.

    URL adapters are named by their public identity (url_names.py); the full URL a request came with (the link)
    is handed to `resolve` beside it, for the fetcher alone.
    """

    def __init__(
        self, local: LocalAdapterDirectory, hub: HubAdapterSource, urls: UrlAdapterSource | None = None
    ) -> None:
        self.local = local
        self.hub = hub
        self.urls = urls

    def check(self, name: str) -> None:
        """Refuse, before anything is loaded or sent, a name that breaks the grammar or a URL this server may not
        fetch."""
        check_name(name)
        if is_url_name(name):
            # No fetcher: no host is allowed, and the policy of none says so.
            (self.urls.policy if self.urls is not None else UrlPolicy()).check(parse_url_name(name))

    def close(self) -> None:
        """Stop downloads under way at their next read (the engine stops)."""
        if self.urls is not None:
            self.urls.close()

    def download_progress(self, name: str) -> DownloadProgress | None:
        """The download of URL adapter `name` under way now, or None."""
        return self.urls.progress(name) if self.urls is not None and is_url_name(name) else None

    @contextlib.contextmanager
    def holding(self, found: AdapterFile) -> Iterator[None]:
        """Keep a URL adapter's downloaded file on disk while the block reads it (the fetch claimed it), then release
        it; when the block raises an EngineError (the bytes are no usable adapter), remove it, so that nothing of
        it stays cached."""
        if found.sha256 is None:
            yield
            return
        try:
            with self.urls.cache.reading(found.sha256):
                yield
        except EngineError:
            self.urls.discard(parse_url_name(found.name), found.sha256)
            raise

    def resolve(self, name: str, link: str | None = None) -> AdapterFile:
        """The file for a name (a URL adapter's from `link`, the full URL its identity `name` stands for), or
        AdapterNotFoundError / AdapterNameError saying what to fix."""
        self.check(name)
        if is_url_name(name):
            return self._fetch_url(name, link)
        if not name.startswith("hf:"):
            found = self.local.find(name)
            if found is not None:
                return found
        ref = parse_hub_ref(name)
        if ref is not None and (name.startswith("hf:") or self.hub.allowed):
            return self.hub.fetch(name, ref)
        # Never the directory's path: callers name adapters relative to it, and server paths are not theirs to see.
        where = "under the adapter directory" if self.local.root else "(the server has no --adapter-dir)"
        raise AdapterNotFoundError(
            f"no adapter named {shorten(name)!r} {where}; check the name, or ListAdapters to see what is cached",
            adapter=name,
        )

    def _fetch_url(self, identity: str, link: str | None) -> AdapterFile:
        url = parse_url_name(link if link is not None else identity)
        if url.identity != parse_url_name(identity).identity:
            raise AdapterNameError(f"the link given for {identity} names another identity")  # never: convert's
        pinned_on_disk = url.sha256 is not None and self.urls.cache.has(url.sha256)
        # An identity given as the name (no link came with it) has a digest where its query was: not fetchable.
        digest_only = "?" in url.link and url_identity(url.link) == url.link
        if digest_only and not pinned_on_disk:
            raise AdapterNameError(
                f"{identity} is a URL identity whose query was left out; send the full URL (its query is never "
                "shown), or pin the file with #sha256="
            )
        return self.urls.fetch(url)
