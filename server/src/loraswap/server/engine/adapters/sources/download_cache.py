"""The disk cache of downloaded adapter files (--adapter-cache-dir), addressed by the SHA-256 of their bytes.

    DIR/sha256/<hex>.safetensors   one file per distinct content, however many URLs reached it
    DIR/urls/<sha256 of identity>.json   what the URL identity last gave: sha256, ETag, Last-Modified, bytes
    DIR/partial/                   downloads under way; emptied at start-up

A download is written under partial/, checked, fsynced and renamed into sha256/ whole, so a file there is always
complete. Under a byte budget (--adapter-cache-dir-bytes) the least recently used files go first to make room
for a new download, never one claimed by a load (from its check to the end of its read); when even that leaves no
room, or the disk itself is full, the download is refused (DISK_CACHE_FULL) and nothing of it stays. One server owns
the folder: it empties partial/ at start-up, and what it reads is known to it alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from loraswap.server.engine.errors import AdapterTooLargeError, ErrorReason

SHA256_HEX = 64


@dataclass(frozen=True)
class UrlRecord:
    """What one URL identity gave when it was last fetched."""

    identity: str
    sha256: str
    bytes: int
    etag: str | None = None
    last_modified: str | None = None
    fetched_unix: float = 0.0


def disk_full_error(needed: int, budget: int | None) -> AdapterTooLargeError:
    where = f"its budget of {budget} bytes (--adapter-cache-dir-bytes)" if budget else "the disk"
    return AdapterTooLargeError(
        f"the adapter download needs {needed} bytes in the server's --adapter-cache-dir and {where} has no room "
        "left once the files not in use are removed; retry later, or ask the operator for more room",
        reason=ErrorReason.DISK_CACHE_FULL,
        needed_bytes=needed,
    )


class DownloadCache:
    """Content-addressed adapter files on disk, with a record per URL identity. Thread-safe."""

    def __init__(self, root: Path, budget_bytes: int = 0) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self._files = root / "sha256"
        self._urls = root / "urls"
        self._partial = root / "partial"
        for folder in (self._files, self._urls, self._partial):
            folder.mkdir(parents=True, exist_ok=True)
        for leftover in self._partial.iterdir():  # a download cut off by a crash or a kill
            with contextlib.suppress(OSError):
                leftover.unlink()
        probe = self._partial / f"probe-{os.getpid()}"
        probe.write_bytes(b"")  # OSError now, at start-up, for a folder this process cannot write
        probe.unlink()
        self._lock = threading.Lock()
        self._reading: dict[str, int] = {}
        self._reserved = 0  # bytes that downloads under way were given room for

    # -- content files ---------------------------------------------------------------------------------------

    def path_of(self, sha256: str) -> Path:
        return self._files / f"{sha256}.safetensors"

    def has(self, sha256: str) -> bool:
        return self.path_of(sha256).is_file()

    def claim(self, sha256: str) -> bool:
        """Whether the file of `sha256` is here; if so it is kept from eviction until `release` (its reader's
        `reading` block takes over), and its use time is now."""
        with self._lock:
            try:
                os.utime(self.path_of(sha256))
            except OSError:
                return False
            self._reading[sha256] = self._reading.get(sha256, 0) + 1
            return True

    def release(self, sha256: str) -> None:
        """End a `claim`."""
        with self._lock:
            self._reading[sha256] -= 1
            if not self._reading[sha256]:
                del self._reading[sha256]

    @contextlib.contextmanager
    def reading(self, claimed_sha256: str) -> Iterator[Path]:
        """The file of a claimed `sha256` (UrlAdapterSource.fetch claims what it returns), kept from eviction while
        the block reads it; released when it ends."""
        try:
            yield self.path_of(claimed_sha256)
        finally:
            self.release(claimed_sha256)

    def discard(self, sha256: str) -> None:
        """Remove a content file (one that downloaded whole but is not a usable adapter), unless another load has
        claimed it meanwhile."""
        with self._lock, contextlib.suppress(OSError):
            if not self._reading.get(sha256):
                self.path_of(sha256).unlink()

    @contextlib.contextmanager
    def room(self, needed: int) -> Iterator[None]:
        """Room for a download of `needed` bytes (its Content-Length; 0: not announced), held until the block ends,
        so that downloads side by side do not overrun the budget together."""
        self.make_room(needed, reserve=True)
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= needed

    def make_room(self, needed: int, *, reserve: bool = False) -> None:
        """Remove least recently used files (none claimed or being read) until `needed` more
        bytes, beside the room downloads under way hold, fit the budget; DISK_CACHE_FULL when they cannot."""
        if not self.budget_bytes or not needed:
            return
        if needed > self.budget_bytes:
            raise disk_full_error(needed, self.budget_bytes)
        with self._lock:
            files = []
            for path in self._files.glob("*.safetensors"):
                with contextlib.suppress(OSError):
                    stat = path.stat()
                    files.append((stat.st_mtime, stat.st_size, path))
            total = sum(size for _, size, _ in files) + self._reserved
            for _, size, path in sorted(files):
                if total + needed <= self.budget_bytes:
                    break
                if path.stem in self._reading:
                    continue
                with contextlib.suppress(OSError):
                    path.unlink()
                    total -= size
            if total + needed > self.budget_bytes:
                raise disk_full_error(needed, self.budget_bytes)
            if reserve:
                self._reserved += needed

    @contextlib.contextmanager
    def partial_file(self) -> Iterator[tuple[Path, object]]:
        """A new file under partial/, open for writing; removed on the way out unless committed (renamed)."""
        path = self._partial / f"{os.getpid()}-{secrets.token_hex(8)}.part"
        try:
            with path.open("wb") as handle:
                yield path, handle
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(path.stat().st_size if path.exists() else 0, None) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    def commit(self, partial: Path, handle, sha256: str) -> Path:
        """Make a finished download the content file of `sha256` (fsynced, then renamed in one step), claimed."""
        handle.flush()
        os.fsync(handle.fileno())
        target = self.path_of(sha256)
        with self._lock:
            os.replace(partial, target)
            self._reading[sha256] = self._reading.get(sha256, 0) + 1  # claimed for its reader, as `claim` does
        return target

    # -- URL records -----------------------------------------------------------------------------------------

    def _record_path(self, identity: str) -> Path:
        return self._urls / f"{hashlib.sha256(identity.encode()).hexdigest()}.json"

    def record(self, identity: str) -> UrlRecord | None:
        """The identity's record when it names a content file still here, else None."""
        try:
            values = json.loads(self._record_path(identity).read_text(encoding="utf-8"))
            record = UrlRecord(**values)
        except (OSError, ValueError, TypeError):
            return None
        if not isinstance(record.sha256, str) or record.identity != identity or len(record.sha256) != SHA256_HEX:
            return None
        if not self.has(record.sha256):
            return None
        return record

    def write_record(self, record: UrlRecord) -> None:
        path = self._record_path(record.identity)
        temporary = path.with_suffix(f".{os.getpid()}-{secrets.token_hex(4)}.tmp")
        temporary.write_text(json.dumps(asdict(record)), encoding="utf-8")
        os.replace(temporary, path)

    def forget(self, identity: str) -> None:
        with contextlib.suppress(OSError):
            self._record_path(identity).unlink()
