"""Typed, immutable results of loraswap calls, converted from the wire messages.

Callers of the client never see a ``*_pb2`` message: every response becomes
one of these frozen dataclasses, each built by its ``from_pb`` classmethod.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.wire import is_map, is_repeated

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

_Record = TypeVar("_Record")


@dataclass(frozen=True, slots=True)
class Queued:
    """The request is waiting; ``position`` 1 means it runs next.

    ``loading_adapter`` is true while the server is still fetching, reading or converting the request's adapter
    (``position`` is 0 then): "loading adapter", not "waiting for the pipeline". While URL adapters download,
    ``downloaded_bytes`` of ``download_total_bytes`` have come (0: the server did not announce a total).
    """

    position: int
    loading_adapter: bool = False
    downloaded_bytes: int = 0
    download_total_bytes: int = 0

    @classmethod
    def from_pb(cls, message: pb.Queued) -> Queued:
        """Converts a ``loraswap.v1.Queued`` message."""
        return _from_message(cls, message)


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
        return _from_message(cls, message)

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
    denoise_ms: float  # the prompt encoded and the steps run
    decode_ms: float  # from the last step to the file written: the VAE decode, then the encoding
    total_ms: float
    encode_prompt_ms: float  # the part of denoise_ms spent in the text encoders
    encode_image_ms: float  # the part of decode_ms spent writing the file (PNG, JPEG, WebP)

    @classmethod
    def from_pb(cls, message: pb.Timings) -> Timings:
        """Converts a ``loraswap.v1.Timings`` message."""
        return _from_message(cls, message)


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
        return _from_message(cls, message)


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
    # The adapters were merged into the base weights for this image (the server's --fuse), not run in its slot.
    fused: bool = False
    # The pipeline components the adapters changed (the denoiser, text encoders whose layers were merged), sorted.
    changed_components: tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, message: pb.Image) -> GeneratedImage:
        """Converts a ``loraswap.v1.Image`` message."""
        return _from_message(cls, message)

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
    kinds: tuple[str, ...] = ()  # the kinds of weight change it makes: lora, dora, loha, lokr, full, ...
    component_layers: dict[str, int] = field(default_factory=dict)  # component -> layers it changes there
    must_fuse: bool = False  # only a fused swap can apply it (a --fuse never server refuses it)

    @classmethod
    def from_pb(cls, message: pb.AdapterInfo) -> AdapterInfo:
        """Converts a ``loraswap.v1.AdapterInfo`` message (its ``bytes`` becomes ``size_bytes``)."""
        return _from_message(cls, message)


@dataclass(frozen=True, slots=True)
class PreloadResult:
    """The outcome of ``preload_adapter``; for a URL adapter, what its download took (0 when it was on disk)."""

    adapter: AdapterInfo
    already_cached: bool
    download_ms: float = 0.0
    download_bytes: int = 0

    @classmethod
    def from_pb(cls, message: pb.PreloadAdapterResponse) -> PreloadResult:
        """Converts a ``loraswap.v1.PreloadAdapterResponse`` message."""
        return _from_message(cls, message)


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
    # The server's own spelling: MODEL_FAMILY_QWEN_IMAGE is "qwen-image".
    return name.removeprefix("MODEL_FAMILY_").lower().replace("_", "-")


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The resident model and its swap slot; ``family`` is "flux", "sdxl", "qwen-image", "z-image", "flux2" or
    "unspecified"."""

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
    base_model: str = ""  # the served base, in the vocabulary adapters declare theirs (a Hub repo id)
    quantization: str = ""  # none, int8wo or fp8: how the denoiser's base linear weights are stored
    denoiser_weight_bytes: int = 0  # the denoiser's weights as stored
    attention_backend: str = ""  # the diffusers attention backend the denoiser runs, e.g. native
    pinned_adapter_memory: bool = False  # cached adapters in pinned host memory (CUDA only)
    device_adapter_bytes: int = 0  # device memory for a hot set of adapters; 0 when none
    fuse: str = ""  # how swaps apply adapters (--fuse): never, always or auto; "" from a server that does not say
    fuse_pristine_bytes: int = 0  # the pristine base-weight copies fused swaps merge from; 0 when none
    torch_threads: int = 0  # the server's fixed CPU threads; 0 when they follow its machine's load

    @classmethod
    def from_pb(cls, message: pb.GetServerInfoResponse) -> ServerInfo:
        """Converts a ``loraswap.v1.GetServerInfoResponse`` message."""
        return _from_message(cls, message)


# -- the wire records, field by field ------------------------------------------------------------------
#
# Each class above converts from its message by field name; what is spelled or typed differently on the wire
# is in the two tables below. Proto `float` fields are float32 and come back as the decimal that was sent
# (_float32_as_written); an unset `optional` field is None; repeated fields become tuples; a nested message
# becomes the class registered for it. tests/client/test_field_maps.py fails when a reply field is missed.

# The message each class is converted from (full proto name -> class), for nested messages too.
CLASS_FOR_MESSAGE: dict[str, type] = {
    message.DESCRIPTOR.full_name: cls
    for message, cls in (
        (pb.Queued, Queued),
        (pb.Progress, Progress),
        (pb.Timings, Timings),
        (pb.StackedAdapter, StackedAdapter),
        (pb.Image, GeneratedImage),
        (pb.AdapterInfo, AdapterInfo),
        (pb.PreloadAdapterResponse, PreloadResult),
        (pb.GetServerInfoResponse, ServerInfo),
    )
}
# Fields whose wire name differs: (class, field) -> the message's field name.
WIRE_NAMES: dict[tuple[type, str], str] = {(AdapterInfo, "size_bytes"): "bytes"}
# Fields whose wire value needs more than its type's rule: (class, field) -> how to read it.
WIRE_VALUES: dict[tuple[type, str], Callable[[Any], object]] = {(ServerInfo, "family"): _family_name}


def _from_message(cls: type[_Record], message: Message) -> _Record:
    """An instance of `cls` from `message`, field by field (see the tables above)."""
    values = {}
    for item in dataclasses.fields(cls):
        wire_name = WIRE_NAMES.get((cls, item.name), item.name)
        descriptor = message.DESCRIPTOR.fields_by_name[wire_name]
        read = WIRE_VALUES.get((cls, item.name))
        if read is not None:
            values[item.name] = read(getattr(message, wire_name))
        elif is_map(descriptor):
            values[item.name] = dict(sorted(getattr(message, wire_name).items()))
        elif is_repeated(descriptor):
            values[item.name] = tuple(_wire_value(descriptor, element) for element in getattr(message, wire_name))
        elif descriptor.message_type is None and descriptor.has_presence and not message.HasField(wire_name):
            values[item.name] = None
        else:
            values[item.name] = _wire_value(descriptor, getattr(message, wire_name))
    return cls(**values)


def _wire_value(descriptor: FieldDescriptor, value: object) -> object:
    """One value of a field as this client holds it."""
    if descriptor.message_type is not None:
        return _from_message(CLASS_FOR_MESSAGE[descriptor.message_type.full_name], value)
    if descriptor.type == FieldDescriptor.TYPE_FLOAT:
        return _float32_as_written(value)
    return value
