"""An adapter's safetensors file, read as untrusted input: its header alone, or the whole file.

A safetensors file opens with 8 little-endian bytes giving the header's length, then the header (a JSON object
whose `__metadata__` maps text to text), then the tensors' bytes. One parser reads that header for both reads:
- the header alone (`read_safetensors_metadata`), for the base-model declarations checked before the tensors are
  read; a header that cannot be parsed declares nothing there, since the whole-file read refuses it with the
  reason why;
- the whole file (`read_adapter_file`), read once and held to the server's size limit, decoded by safetensors,
  and the LoraConfig that diffusers stores in its metadata checked before anything parses it further.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterTooLargeError, ErrorReason, shorten

if TYPE_CHECKING:
    import torch

# safetensors' own limit on a header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# diffusers stores the LoraConfig of each component in this safetensors metadata key.
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# Metadata is untrusted input: honest LoraConfig JSON is a few kilobytes.
MAX_METADATA_CHARS = 1 << 20


def _header_metadata(stream: BinaryIO, limit: int) -> dict:
    """The `__metadata__` of the header `stream` starts with, {} when it has none.

    Raises ValueError or RecursionError when the header's length is not in 1..limit or the header is not JSON.
    """
    length = int.from_bytes(stream.read(8), "little")
    # Checked before reading: the length is untrusted and may claim any size up to 2**64.
    if not 0 < length <= limit:
        raise ValueError(f"a header length of {length} bytes, outside 1..{limit}")
    header = json.loads(stream.read(length))
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def read_safetensors_metadata(path: Path, max_bytes: int = 0) -> dict:
    """The `__metadata__` of a safetensors file, reading its header only; {} when there is none or it is unreadable."""
    limit = min(MAX_HEADER_BYTES, max_bytes) if max_bytes else MAX_HEADER_BYTES
    try:
        with open(path, "rb") as handle:
            return _header_metadata(handle, limit)
    # Unreadable or not JSON: no declaration here; the tensor reader refuses the file with the reason why.
    except (OSError, ValueError, RecursionError):
        return {}


def _read_bytes(adapter_file: AdapterFile) -> bytes:
    """The whole file, read once (never mapped) and held to the size limit even if it grew since it was found."""
    limit = adapter_file.max_bytes
    try:
        with open(adapter_file.path, "rb") as handle:
            data = handle.read(limit + 1) if limit else handle.read()
    except OSError as exc:
        raise AdapterFormatError(
            f"adapter {shorten(adapter_file.name)!r} cannot be read ({exc.strerror or type(exc).__name__}); "
            "check the file and its permissions"
        ) from exc
    if limit and len(data) > limit:
        raise AdapterTooLargeError(
            f"adapter {shorten(adapter_file.name)!r} is over the server's limit of {limit} bytes "
            "(--max-adapter-bytes); use a smaller rank or fewer layers",
            max_bytes=limit,
        )
    return data


def _lora_adapter_metadata(raw: str | None, label: str) -> dict | None:
    """The LoraConfig JSON diffusers stored in the metadata, None when there is none; refused unless an object."""
    if raw and len(raw) > MAX_METADATA_CHARS:
        raise AdapterFormatError(
            f"adapter {label!r} has {len(raw)} characters of '{LORA_ADAPTER_METADATA_KEY}' metadata, more than the "
            f"{MAX_METADATA_CHARS} accepted; save the adapter with its LoraConfig only",
            reason=ErrorReason.ADAPTER_BAD_METADATA,
        )
    try:
        metadata = json.loads(raw) if raw else None
    except (ValueError, RecursionError) as exc:  # not JSON, nested too deep, a number too long to convert
        raise AdapterFormatError(
            f"adapter {label!r} has malformed '{LORA_ADAPTER_METADATA_KEY}' metadata ({shorten(exc)}); "
            "re-save it with diffusers",
            reason=ErrorReason.ADAPTER_BAD_METADATA,
        ) from exc
    if metadata is not None and not isinstance(metadata, dict):
        raise AdapterFormatError(
            f"adapter {label!r} has '{LORA_ADAPTER_METADATA_KEY}' metadata that is not a JSON object",
            reason=ErrorReason.ADAPTER_BAD_METADATA,
        )
    return metadata


def read_adapter_file(adapter_file: AdapterFile) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Tensors and LoraConfig metadata of an adapter file.

    Every tensor owns a copy of its bytes: nothing stays mapped from the file (safe_open would mmap it), so a
    file truncated or rewritten after it was cached can neither crash the server (SIGBUS on a mapped page) nor
    change the validated weights the cache holds.
    """
    from safetensors.torch import load

    data = _read_bytes(adapter_file)
    label = shorten(adapter_file.name)
    try:
        state_dict = load(data)
        header = _header_metadata(io.BytesIO(data), MAX_HEADER_BYTES)
    # Decoding untrusted bytes: whatever safetensors or torch raise means the same thing, an unreadable file.
    except Exception as exc:
        raise AdapterFormatError(
            f"adapter {label!r} is not a readable safetensors file ({shorten(exc)}); "
            "re-export or re-download the adapter"
        ) from exc
    del data
    return state_dict, _lora_adapter_metadata(header.get(LORA_ADAPTER_METADATA_KEY), label)
