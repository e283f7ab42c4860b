"""The adapter directory (--adapter-dir): local names as files or folders under one root; nothing outside it is
reachable, whatever a symlink says.
"""

from __future__ import annotations

from pathlib import Path

from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.adapter_folder import (
    MODEL_CARD_NAME,
    PICKLE_SUFFIXES,
    check_file_size,
    pick_weight_file,
)
from loraswap.server.engine.adapters.sources.adapter_names import is_local_name
from loraswap.server.engine.errors import (
    AdapterFormatError,
    AdapterNameError,
    AdapterNotFoundError,
    ErrorReason,
    shorten,
)


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
        if self.root is None or not is_local_name(name):
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
        check_file_size(real, self.max_adapter_bytes)
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
