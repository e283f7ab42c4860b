"""Where an adapter's file comes from, by its name: an https:// URL through its fetcher (url_fetch.py), else the
adapter directory (local_directory.py), then the Hugging Face Hub (hub_source.py).

A source only turns a name into a local safetensors file; it never reads the weights. The names' grammar is
adapter_names.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from loraswap.adapter_urls import url_identity
from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.adapter_names import check_name, parse_hub_ref
from loraswap.server.engine.adapters.sources.hub_source import HubAdapterSource
from loraswap.server.engine.adapters.sources.local_directory import LocalAdapterDirectory
from loraswap.server.engine.adapters.sources.url_names import is_url_name, parse_url_name
from loraswap.server.engine.adapters.sources.url_policy import UrlPolicy
from loraswap.server.engine.errors import AdapterNameError, AdapterNotFoundError, EngineError, shorten

if TYPE_CHECKING:
    from loraswap.server.engine.adapters.sources.url_fetch import DownloadProgress, UrlAdapterSource


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
