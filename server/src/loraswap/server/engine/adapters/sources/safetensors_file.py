"""An adapter's safetensors file, read as untrusted input: its header alone, or the whole file.

A safetensors file opens with 8 little-endian bytes giving the header's length, then the header (a JSON object
whose `__metadata__` maps text to text), then the tensors' bytes. One parser reads that header for both reads:
- the header alone (`read_safetensors_metadata`), for the base-model declarations checked before the tensors are
  read; a header that cannot be parsed declares nothing there, since the whole-file read refuses it with the
  reason why;
- the whole file (`read_adapter_file`), held to the server's size limit, each tensor read straight from the file
  into a buffer of its own (one copy, what reading a mapped file and copying it out costs; no intermediate
  bytes object), after the header is checked as safetensors checks it: known dtypes, every
  tensor's bytes matching its shape, the tensors covering the data exactly, without holes or overlaps; and the
  LoraConfig that diffusers stores in its metadata checked before anything parses it further.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterTooLargeError, ErrorReason, shorten

if TYPE_CHECKING:
    import torch

# safetensors' own limit on a header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# diffusers stores the LoraConfig of each component in this safetensors metadata key.
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# Metadata is untrusted input: honest LoraConfig JSON is a few kilobytes.
MAX_METADATA_CHARS = 1 << 20
# A file that changes while it is read is read again this many times in all, waiting a little longer each time.
READ_ATTEMPTS = 4
REREAD_DELAY_S = 0.05


def _header(stream: BinaryIO, limit: int) -> tuple[dict, int]:
    """The header `stream` starts with, and its length.

    Raises ValueError or RecursionError when the header's length is not in 1..limit or the header is not a JSON
    object.
    """
    length = int.from_bytes(stream.read(8), "little")
    # Checked before reading: the length is untrusted and may claim any size up to 2**64.
    if not 0 < length <= limit:
        raise ValueError(f"a header length of {length} bytes, outside 1..{limit}")
    header = json.loads(stream.read(length))
    if not isinstance(header, dict):
        raise ValueError("a header that is not a JSON object")  # noqa: TRY004 (one error type: an unreadable file)
    return header, length


def _metadata_of(header: dict) -> dict:
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _header_metadata(stream: BinaryIO, limit: int) -> dict:
    """The `__metadata__` of the header `stream` starts with, {} when it has none (raises as _header does)."""
    return _metadata_of(_header(stream, limit)[0])


def read_safetensors_metadata(path: Path, max_bytes: int = 0) -> dict:
    """The `__metadata__` of a safetensors file, reading its header only; {} when there is none or it is unreadable."""
    limit = min(MAX_HEADER_BYTES, max_bytes) if max_bytes else MAX_HEADER_BYTES
    try:
        with open(path, "rb") as handle:
            return _header_metadata(handle, limit)
    # Unreadable or not JSON: no declaration here; the tensor reader refuses the file with the reason why.
    except (OSError, ValueError, RecursionError):
        return {}


def has_safetensors_header(path: Path) -> bool:
    """Whether a file opens as a safetensors file does: a header length that fits the file, then a JSON object."""
    try:
        with open(path, "rb") as handle:
            _, length = _header(handle, min(MAX_HEADER_BYTES, max(0, path.stat().st_size - 8)))
    except (OSError, ValueError, RecursionError):
        return False
    return length > 0


# safetensors' dtype names -> (torch's, bytes per element).
_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}  # fmt: skip


def _layout(header: dict, data_bytes: int) -> list[tuple[str, str, list[int], int, int]]:
    """(name, torch dtype, shape, start, stop) of each tensor, in file order, checked as safetensors checks a
    header: known dtypes, whole-number shapes, each tensor's bytes its shape's, the data covered exactly.
    Raises ValueError saying what is wrong."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise ValueError(f"tensor {shorten(name)!r} has no dtype safetensors knows")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {shorten(name)!r} has an invalid shape")
        if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
            raise ValueError(f"tensor {shorten(name)!r} has invalid data offsets")
        dtype, itemsize = _DTYPES[entry["dtype"]]
        start, stop = offsets
        if stop - start != math.prod(shape) * itemsize:
            raise ValueError(f"tensor {shorten(name)!r} has {stop - start} bytes for shape {shape}")
        entries.append((name, dtype, shape, start, stop))
    entries.sort(key=lambda entry: entry[3])
    end = 0
    for name, _, _, start, stop in entries:
        if start != end:
            raise ValueError(f"tensor {shorten(name)!r} starts at byte {start} of the data, not {end}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"the tensors hold {end} bytes, the file's data {data_bytes}")
    return entries


def _read_into(handle: BinaryIO, buffer) -> None:
    view = memoryview(buffer)
    while view.nbytes:
        read = handle.readinto(view)
        if not read:
            raise ValueError("the file ends inside its tensors' data")
        view = view[read:]


def _read_tensors(handle: BinaryIO, size: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of an open safetensors file of `size` bytes, each read into a buffer of its own, and the
    header's metadata."""
    import torch

    header, length = _header(handle, min(MAX_HEADER_BYTES, max(size - 8, 0)))
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise ValueError("__metadata__ that is not a map of text to text")
    tensors = {}
    for name, dtype, shape, start, stop in _layout(header, size - 8 - length):
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        _read_into(handle, buffer.numpy())
        tensor = buffer.view(getattr(torch, dtype))
        if sys.byteorder != "little":  # safetensors stores little-endian
            tensor = tensor.view(torch.uint8).view(-1, tensor.element_size()).flip(1).reshape(-1).view(tensor.dtype)
        tensors[name] = tensor.reshape(shape)
    return tensors, metadata


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

    The tensors hold a copy of the file's bytes: nothing stays mapped from the file (safe_open would mmap it), so a
    file truncated or rewritten after it was cached can neither crash the server (SIGBUS on a mapped page) nor
    change the validated weights the cache holds. The size limit is held at reading time, even if the file grew
    since it was found. A file written to while it is read (its size or times differ after the read from before
    it) is read again, up to READ_ATTEMPTS times: what is served is the old file or the new one, never a mix.
    """
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            return _read_adapter_file(adapter_file)
        except _ChangedWhileRead as changed:
            if attempt == READ_ATTEMPTS:
                raise AdapterFormatError(
                    f"adapter {shorten(adapter_file.name)!r} kept changing while it was read ({READ_ATTEMPTS} "
                    "tries); write the new file beside it and rename it over the old one, then retry",
                ) from changed.error
            time.sleep(REREAD_DELAY_S * attempt)
    raise AssertionError("unreachable")


class _ChangedWhileRead(Exception):
    def __init__(self, error: BaseException | None) -> None:
        super().__init__("changed while read")
        self.error = error


def _identity(handle: BinaryIO) -> tuple[int, int, int]:
    """What changes when the open file is written to: its size and times. (A file replaced by a rename leaves the
    open one as it was: that read is the old file, whole.)"""
    opened = os.fstat(handle.fileno())
    return opened.st_size, opened.st_mtime_ns, opened.st_ctime_ns


def _read_adapter_file(adapter_file: AdapterFile) -> tuple[dict[str, torch.Tensor], dict | None]:
    label = shorten(adapter_file.name)
    limit = adapter_file.max_bytes
    try:
        with open(adapter_file.path, "rb") as handle:
            before = _identity(handle)
            size = before[0]
            if limit and size > limit:
                raise AdapterTooLargeError(
                    f"adapter {label!r} is over the server's limit of {limit} bytes (--max-adapter-bytes); use a "
                    "smaller rank or fewer layers",
                    max_bytes=limit,
                )
            try:
                state_dict, metadata = _read_tensors(handle, size)
            # Decoding untrusted bytes: whatever json or torch raise means the same thing, an unreadable file.
            except (ValueError, RecursionError, OverflowError, RuntimeError, TypeError) as exc:
                if _identity(handle) != before:
                    raise _ChangedWhileRead(exc) from exc
                raise AdapterFormatError(
                    f"adapter {label!r} is not a readable safetensors file ({shorten(exc)}); "
                    "re-export or re-download the adapter"
                ) from exc
            if _identity(handle) != before:
                raise _ChangedWhileRead(None)
    except OSError as exc:
        raise AdapterFormatError(
            f"adapter {label!r} cannot be read ({exc.strerror or type(exc).__name__}); check the file and its "
            "permissions"
        ) from exc
    return state_dict, _lora_adapter_metadata(metadata.get(LORA_ADAPTER_METADATA_KEY), label)
