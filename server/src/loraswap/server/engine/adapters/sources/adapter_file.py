"""What every source hands on: a local safetensors file that holds an adapter, and where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class AdapterFile:
    """A local safetensors file that holds an adapter, where it came from, and how many bytes it may have."""

    name: str
    path: Path
    source: str  # shown to callers: relative to the adapter directory, never a server path
    # The size limit checked when the file was found, checked again by whoever reads it (it may have grown since).
    max_bytes: int = field(default=0, compare=False)
    # The model card beside the weights (the adapter's folder, the Hub repo's README.md), if there is one.
    model_card: Path | None = field(default=None, compare=False)
    # A URL adapter's: the SHA-256 of its bytes (its file in the disk cache), and what fetching it took.
    sha256: str | None = field(default=None, compare=False)
    download_ms: float = field(default=0.0, compare=False)
    download_bytes: int = field(default=0, compare=False)
