"""The adapter sources an EngineConfig names: the adapter directory (or the demo adapters a built-in model ships
with), the Hugging Face Hub, and the fetcher of URL adapters under the --allow-url-host rules."""

from __future__ import annotations

from pathlib import Path

from loraswap.server.engine.adapters.sources import (
    AdapterSources,
    DownloadCache,
    HubAdapterSource,
    LocalAdapterDirectory,
    UrlAdapterSource,
    UrlPolicy,
    UrlTimeouts,
    UrlTokens,
)
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import StartupError
from loraswap.server.engine.models import BUILTINS
from loraswap.server.engine.observer import EngineObserver


def configured_sources(config: EngineConfig, observer: EngineObserver) -> AdapterSources:
    """Where the adapter names of requests resolve, as `config` says; `observer` hears of URL downloads.

    Raises:
        StartupError: the --adapter-cache-dir of URL adapters cannot be made or written (one line).
    """
    return AdapterSources(
        LocalAdapterDirectory(config.adapter_dir or _shipped_adapter_dir(config.model), config.max_adapter_bytes),
        HubAdapterSource(config.allow_hub, config.max_adapter_bytes),
        url_adapter_source(config, observer),
    )


def url_adapter_source(config: EngineConfig, observer: EngineObserver) -> UrlAdapterSource | None:
    """The fetcher of URL adapters under the config's --allow-url-host rules, or None when no host is allowed."""
    if not (config.allow_url_host or config.allow_insecure_url_host):
        return None
    policy = UrlPolicy(
        allowed_hosts=config.allow_url_host,
        insecure_hosts=config.allow_insecure_url_host,
        allow_private_addresses=config.allow_url_private_addresses,
        tokens=UrlTokens(config.url_token_file),
    )
    try:
        cache = DownloadCache(config.download_cache_dir, config.adapter_cache_dir_bytes)
    except OSError as error:
        raise StartupError(
            f"--adapter-cache-dir {config.download_cache_dir}: cannot be made or written ({error.strerror}); give a "
            "writable folder"
        ) from None
    return UrlAdapterSource(
        policy,
        cache,
        max_adapter_bytes=config.max_adapter_bytes,
        ca_file=config.url_ca_file,
        timeouts=UrlTimeouts(io_s=config.url_timeout_seconds, deadline_s=config.url_deadline_seconds),
        observer=observer,
    )


def _shipped_adapter_dir(model: str) -> Path | None:
    """The demo adapters that ship with a built-in model, served when no --adapter-dir is given."""
    builtin = BUILTINS.get(model)
    return builtin.adapter_dir if builtin is not None else None
