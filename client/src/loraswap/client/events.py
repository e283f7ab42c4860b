"""Typed, immutable results of loraswap calls, converted from the wire messages.

Callers of the client never see a ``*_pb2`` message: every response becomes
one of these frozen dataclasses, each built by its ``from_pb`` classmethod.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from loraswap.v1 import diffusion_service_pb2 as pb

__all__ = [
    "AdapterInfo",
    "AdapterList",
    "Event",
    "GenerateStreamDecoder",
    "GeneratedImage",
    "PreloadResult",
    "Progress",
    "Queued",
    "ServerInfo",
    "StackedAdapter",
    "Timings",
    "event_from_pb",
]


@dataclass(frozen=True, slots=True)
class Queued:
    """The request is waiting; ``position`` 1 means it runs next.

    ``loading_adapter`` is true while the server is still fetching, reading or converting the request's adapter
    (``position`` is 0 then): "loading adapter", not "waiting for the pipeline".
    """

    position: int
    loading_adapter: bool = False

    @classmethod
    def from_pb(cls, message: pb.Queued) -> Queued:
        """Converts a ``loraswap.v1.Queued`` message."""
        return cls(position=message.position, loading_adapter=message.loading_adapter)


@dataclass(frozen=True, slots=True)
class Progress:
    """Denoising step ``step`` of ``total_steps`` has completed.

    With ``preview_every`` in the request, every that many steps and at the last, ``preview`` holds a
    small encoded picture of the image being formed (at most 256 px on its longer side, the image's
    aspect ratio) and ``preview_mime_type`` its type; both are empty on the other steps.
    """

    step: int
    total_steps: int
    elapsed_ms: float
    # Kept out of repr so that printing an event does not dump the picture's bytes.
    preview: bytes = field(default=b"", repr=False)
    preview_mime_type: str = ""

    @classmethod
    def from_pb(cls, message: pb.Progress) -> Progress:
        """Converts a ``loraswap.v1.Progress`` message."""
        return cls(
            step=message.step,
            total_steps=message.total_steps,
            elapsed_ms=message.elapsed_ms,
            preview=message.preview,
            preview_mime_type=message.preview_mime_type,
        )

    @property
    def preview_extension(self) -> str:
        """The usual file extension for ``preview_mime_type``, without the dot ("" when there is no preview)."""
        return _EXTENSION_BY_MIME_TYPE.get(self.preview_mime_type, "bin") if self.preview else ""


@dataclass(frozen=True, slots=True)
class Timings:
    """Where a generation's time went, in milliseconds."""

    queue_ms: float
    adapter_load_ms: float
    adapter_swap_ms: float
    denoise_ms: float
    decode_ms: float
    total_ms: float

    @classmethod
    def from_pb(cls, message: pb.Timings) -> Timings:
        """Converts a ``loraswap.v1.Timings`` message."""
        return cls(
            queue_ms=message.queue_ms,
            adapter_load_ms=message.adapter_load_ms,
            adapter_swap_ms=message.adapter_swap_ms,
            denoise_ms=message.denoise_ms,
            decode_ms=message.decode_ms,
            total_ms=message.total_ms,
        )


def _float32_as_written(value: float) -> float:
    """The shortest decimal that the float32 ``value`` came from (0.800000011920929 -> 0.8).

    Proto ``float`` fields are float32, so a scale sent as 0.8 comes back as
    0.800000011920929; users compare and print it as the 0.8 they wrote.
    """
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", candidate))[0] == value:
            return candidate
    return value


@dataclass(frozen=True, slots=True)
class StackedAdapter:
    """One adapter of a request and its strength: ``generate(..., adapters=[StackedAdapter("ink", 0.8), ...])``.

    In a request, ``scale`` None means 1.0; in a result it is the strength applied.
    """

    adapter: str
    scale: float | None = None

    @classmethod
    def from_pb(cls, message: pb.StackedAdapter) -> StackedAdapter:
        """Converts a ``loraswap.v1.StackedAdapter`` message (unset ``scale``: None)."""
        return cls(
            adapter=message.adapter,
            scale=_float32_as_written(message.scale) if message.HasField("scale") else None,
        )


_EXTENSION_BY_MIME_TYPE = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp"}


@dataclass(frozen=True, slots=True)
class GeneratedImage:
    """A finished generation: the encoded image and how it was made."""

    # Kept out of repr so that printing a result does not dump megabytes.
    data: bytes = field(repr=False)
    mime_type: str
    width: int
    height: int
    seed: int
    adapter: str
    adapter_scale: float
    timings: Timings
    warnings: tuple[str, ...]
    # Every adapter applied, with its strength, as the request named them: one for a single
    # ``adapter``, several for a stack (then ``adapter`` is empty), none for the base model.
    adapters: tuple[StackedAdapter, ...] = ()

    @classmethod
    def from_pb(cls, message: pb.Image) -> GeneratedImage:
        """Converts a ``loraswap.v1.Image`` message."""
        return cls(
            data=message.data,
            mime_type=message.mime_type,
            width=message.width,
            height=message.height,
            seed=message.seed,
            adapter=message.adapter,
            adapter_scale=_float32_as_written(message.adapter_scale),
            timings=Timings.from_pb(message.timings),
            warnings=tuple(message.warnings),
            adapters=tuple(StackedAdapter.from_pb(applied) for applied in message.adapters),
        )

    @property
    def extension(self) -> str:
        """The usual file extension for ``mime_type``, without the dot."""
        return _EXTENSION_BY_MIME_TYPE.get(self.mime_type, "bin")

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the encoded image to ``path`` as is and returns the path."""
        destination = Path(path)
        destination.write_bytes(self.data)
        return destination


Event = Queued | Progress | GeneratedImage
"""One event of a ``generate`` stream."""


def event_from_pb(message: pb.GenerateResponse) -> Event | None:
    """Converts one ``GenerateResponse`` on its own; None for an event kind this client does not know.

    An ``image`` event alone holds only the last piece of an image sent in chunks;
    :class:`GenerateStreamDecoder` joins the pieces.
    """
    kind = message.WhichOneof("event")
    if kind == "queued":
        return Queued.from_pb(message.queued)
    if kind == "progress":
        return Progress.from_pb(message.progress)
    if kind == "image":
        return GeneratedImage.from_pb(message.image)
    return None


class GenerateStreamDecoder:
    """Turns the messages of one Generate stream into events, joining ``image_chunk`` pieces into the image.

    The contract sends an image too large for one message (over 1 MiB) as
    ``image_chunk`` events followed by the ``image`` event, whose ``data`` is
    the last piece; the decoded :class:`GeneratedImage` holds the whole file.
    """

    def __init__(self) -> None:
        self._image_pieces: list[bytes] = []

    def decode(self, message: pb.GenerateResponse) -> Event | None:
        """The event for ``message``; None for an image chunk (kept for the image) or an unknown event kind."""
        kind = message.WhichOneof("event")
        if kind == "image_chunk":
            self._image_pieces.append(message.image_chunk.data)
            return None
        event = event_from_pb(message)
        if kind == "image" and self._image_pieces:
            pieces, self._image_pieces = self._image_pieces, []
            return dataclasses.replace(event, data=b"".join([*pieces, message.image.data]))
        return event


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """One adapter in the server's cache."""

    id: str
    rank: int
    target_layers: tuple[str, ...]
    size_bytes: int
    source: str
    hits: int
    last_used_unix_ms: int
    resident: bool
    load_ms: float
    warnings: tuple[str, ...]
    pinned: bool = False  # kept out of the server's LRU eviction (--pin)

    @classmethod
    def from_pb(cls, message: pb.AdapterInfo) -> AdapterInfo:
        """Converts a ``loraswap.v1.AdapterInfo`` message (its ``bytes`` becomes ``size_bytes``)."""
        return cls(
            id=message.id,
            rank=message.rank,
            target_layers=tuple(message.target_layers),
            size_bytes=message.bytes,
            source=message.source,
            hits=message.hits,
            last_used_unix_ms=message.last_used_unix_ms,
            resident=message.resident,
            load_ms=message.load_ms,
            warnings=tuple(message.warnings),
            pinned=message.pinned,
        )


@dataclass(frozen=True, slots=True)
class PreloadResult:
    """The outcome of ``preload_adapter``."""

    adapter: AdapterInfo
    already_cached: bool

    @classmethod
    def from_pb(cls, message: pb.PreloadAdapterResponse) -> PreloadResult:
        """Converts a ``loraswap.v1.PreloadAdapterResponse`` message."""
        return cls(adapter=AdapterInfo.from_pb(message.adapter), already_cached=message.already_cached)


@dataclass(frozen=True, slots=True)
class AdapterList:
    """The server's adapter cache: most recently used first."""

    adapters: tuple[AdapterInfo, ...]
    cache_bytes: int
    cache_budget_bytes: int

    @classmethod
    def from_pb(cls, message: pb.ListAdaptersResponse) -> AdapterList:
        """Converts a ``loraswap.v1.ListAdaptersResponse`` message (one page)."""
        return cls.from_pages([message])

    @classmethod
    def from_pages(cls, pages: list[pb.ListAdaptersResponse]) -> AdapterList:
        """Joins the pages of one listing, in order; an adapter on two pages (it was used in between) is kept
        where it came first. The cache's figures are the last page's, the newest."""
        seen: set[str] = set()
        adapters = []
        for page in pages:
            for adapter in page.adapters:
                if adapter.id not in seen:
                    seen.add(adapter.id)
                    adapters.append(AdapterInfo.from_pb(adapter))
        return cls(
            adapters=tuple(adapters),
            cache_bytes=pages[-1].cache_bytes,
            cache_budget_bytes=pages[-1].cache_budget_bytes,
        )


def _family_name(family: int) -> str:
    try:
        name = pb.ModelFamily.Name(family)
    except ValueError:
        # A family added to the contract after this client was built.
        return "unspecified"
    return name.removeprefix("MODEL_FAMILY_").lower()


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The resident model and its swap slot; ``family`` is "flux", "sdxl" or "unspecified"."""

    model: str
    family: str
    dtype: str
    device: str
    max_rank: int
    target_layers: tuple[str, ...]
    compiled: bool
    recompilations: int
    resident_adapter: str
    size_multiple: int
    min_size: int
    max_size: int
    default_width: int
    default_height: int
    default_num_inference_steps: int
    default_guidance_scale: float
    resident_adapters: tuple[str, ...] = ()  # every adapter in the slot (a stack's members), by name
    max_stack: int = 0  # most adapters one request may stack; 0 from a server without stacks
    rank_buckets: tuple[int, ...] = ()  # the ranks the slot computes at (a request pays its bucket); () if unsaid
    compile_mode: str = ""  # "full/default", "regional/max-autotune", "none"; "" from a server that does not say

    @classmethod
    def from_pb(cls, message: pb.GetServerInfoResponse) -> ServerInfo:
        """Converts a ``loraswap.v1.GetServerInfoResponse`` message."""
        return cls(
            model=message.model,
            family=_family_name(message.family),
            dtype=message.dtype,
            device=message.device,
            max_rank=message.max_rank,
            target_layers=tuple(message.target_layers),
            compiled=message.compiled,
            recompilations=message.recompilations,
            resident_adapter=message.resident_adapter,
            size_multiple=message.size_multiple,
            min_size=message.min_size,
            max_size=message.max_size,
            default_width=message.default_width,
            default_height=message.default_height,
            default_num_inference_steps=message.default_num_inference_steps,
            default_guidance_scale=_float32_as_written(message.default_guidance_scale),
            resident_adapters=tuple(message.resident_adapters),
            max_stack=message.max_stack,
            rank_buckets=tuple(message.rank_buckets),
            compile_mode=message.compile_mode,
        )
