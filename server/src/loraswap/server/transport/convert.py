"""Proto <-> domain conversions; the only place that knows both shapes."""

from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from loraswap.server.engine.adapters.sources import is_url_name, loggable_name, parse_url_name, split_names
from loraswap.server.engine.types import (
    AdapterCacheSummary,
    AdapterSummary,
    FuseChoice,
    GeneratedImage,
    GenerationEvent,
    GenerationRequest,
    ImageFormat,
    ModelFamily,
    PreloadResult,
    Queued,
    ServerDescription,
    StackedAdapter,
    StepProgress,
    Timings,
)
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.wire import LORA_METADATA_KEY, is_map, is_repeated

_IMAGE_FORMAT_FROM_PB = {
    pb.IMAGE_FORMAT_UNSPECIFIED: ImageFormat.PNG,
    pb.IMAGE_FORMAT_PNG: ImageFormat.PNG,
    pb.IMAGE_FORMAT_JPEG: ImageFormat.JPEG,
    pb.IMAGE_FORMAT_WEBP: ImageFormat.WEBP,
}
# FUSE_CHOICE_UNSPECIFIED: the server's policy.
_FUSE_CHOICE_FROM_PB = {
    pb.FUSE_CHOICE_UNSPECIFIED: None,
    pb.FUSE_CHOICE_FUSED: FuseChoice.FUSED,
    pb.FUSE_CHOICE_UNFUSED: FuseChoice.UNFUSED,
}
_FAMILY_TO_PB = {
    ModelFamily.FLUX: pb.MODEL_FAMILY_FLUX,
    ModelFamily.SDXL: pb.MODEL_FAMILY_SDXL,
    ModelFamily.QWEN_IMAGE: pb.MODEL_FAMILY_QWEN_IMAGE,
    ModelFamily.Z_IMAGE: pb.MODEL_FAMILY_Z_IMAGE,
    ModelFamily.FLUX2: pb.MODEL_FAMILY_FLUX2,
}

# The contract's bound on every message of a Generate stream: a quarter of the 4 MiB that every gRPC stack
# (Go, Java, C++, Node, grpcurl, Python) accepts by default, so an image of any size reaches any client.
MAX_GENERATE_RESPONSE_BYTES = 1024 * 1024
# One image_chunk's bytes: the bound less room for the message's own framing (tags and lengths, a few bytes).
IMAGE_CHUNK_BYTES = MAX_GENERATE_RESPONSE_BYTES - 1024


def _optional(message, field: str):
    return getattr(message, field) if message.HasField(field) else None


def public_adapter_name(name: str, links: dict[str, str]) -> str:
    """The name the engine and every reply, log and metric know an adapter by: a URL's public identity (its link,
    a secret, put in `links`), any other name itself. AdapterNameError for a malformed URL."""
    if not is_url_name(name):
        return name
    url = parse_url_name(name)
    links.setdefault(url.identity, name)  # a request field's full URL over the `lora` metadata's identity
    return url.identity


def adapter_and_link(name: str) -> tuple[str, str | None]:
    """PreloadAdapter / Evict: the adapter's public name, and its link when it is a URL."""
    links: dict[str, str] = {}
    public = public_adapter_name(name, links)
    return public, links.get(public)


def generation_request_from_pb(request: pb.GenerateRequest) -> GenerationRequest:
    """GenerateRequest -> GenerationRequest; unset optional fields become None (model defaults); URL adapters by
    their public identity, their links in adapter_links."""
    from loraswap.server.engine.errors import InvalidRequestError

    image_format = _IMAGE_FORMAT_FROM_PB.get(request.image_format)
    if image_format is None:
        raise InvalidRequestError(
            f"image_format {request.image_format} is unknown; use IMAGE_FORMAT_PNG, _JPEG or _WEBP",
            field="image_format",
        )
    if request.fuse not in _FUSE_CHOICE_FROM_PB:
        raise InvalidRequestError(
            f"fuse {request.fuse} is unknown; use FUSE_CHOICE_FUSED, FUSE_CHOICE_UNFUSED, or leave it unset for the "
            "server's --fuse policy",
            field="fuse",
        )
    links: dict[str, str] = {}
    return GenerationRequest(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        adapter=public_adapter_name(request.adapter, links),
        adapter_scale=_optional(request, "adapter_scale"),
        adapters=tuple(
            StackedAdapter(public_adapter_name(entry.adapter, links), _optional(entry, "scale"))
            for entry in request.adapters
        ),
        num_inference_steps=_optional(request, "num_inference_steps"),
        guidance_scale=_optional(request, "guidance_scale"),
        width=_optional(request, "width"),
        height=_optional(request, "height"),
        seed=_optional(request, "seed"),
        image_format=image_format,
        preview_every=request.preview_every,
        fuse=_FUSE_CHOICE_FROM_PB[request.fuse],
        adapter_links=links,
    )


def lora_names(metadata) -> tuple[str, ...]:
    """The adapter names the `lora` call metadata carries, in order; () when it is absent or empty."""
    for key, value in metadata or ():
        if key == LORA_METADATA_KEY:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return split_names(text)
    return ()


def _metadata_mismatch(names: tuple[str, ...], requested: tuple[str, ...]):
    from loraswap.server.engine.errors import ErrorReason, InvalidRequestError, shorten

    return InvalidRequestError(
        f"the lora metadata names {shorten(','.join(names))!r} but the request names "
        f"{shorten(','.join(requested))!r}; send the same adapters in both, or name them in one place only",
        reason=ErrorReason.ADAPTER_MISMATCH,
        field="adapter",
    )


def with_lora_metadata(request: GenerationRequest, names: tuple[str, ...]) -> GenerationRequest:
    """The request with its adapters taken from the `lora` metadata when its fields name none.

    When both name adapters they must agree (a stack's members in any order), else ADAPTER_MISMATCH.
    """
    from dataclasses import replace

    if not names:
        return request
    links = dict(request.adapter_links)
    names = tuple(public_adapter_name(name, links) for name in names)
    request = replace(request, adapter_links=links)
    requested = (request.adapter,) if request.adapter else tuple(member.adapter for member in request.adapters)
    if not requested:
        if len(names) == 1:
            return replace(request, adapter=names[0])
        return replace(request, adapters=tuple(StackedAdapter(name, None) for name in names))
    if sorted(requested) != sorted(names):
        raise _metadata_mismatch(names, requested)
    return request


def adapter_with_lora_metadata(adapter: str, names: tuple[str, ...]) -> str:
    """PreloadAdapter / Evict: the adapter field, or the one adapter the `lora` metadata names; they must agree, a
    URL by its identity (clients send the full URL in the field and its identity as the metadata): the field's
    then wins, for it is the one that can be fetched."""
    if not names:
        return adapter
    if len(names) != 1 or (adapter and loggable_name(adapter) != loggable_name(names[0])):
        requested = (loggable_name(adapter),) if adapter else ()
        raise _metadata_mismatch(tuple(map(loggable_name, names)), requested)
    return adapter or names[0]


# -- replies: domain records written as their messages, field by field -----------------------------------

# The message each domain record is written as.
MESSAGE_FOR_RECORD: dict[type, type[Message]] = {
    Queued: pb.Queued,
    StepProgress: pb.Progress,
    Timings: pb.Timings,
    StackedAdapter: pb.StackedAdapter,
    GeneratedImage: pb.Image,
    AdapterSummary: pb.AdapterInfo,
    PreloadResult: pb.PreloadAdapterResponse,
    ServerDescription: pb.GetServerInfoResponse,
}
# Wire fields that are no field of the record by the same name: (record, wire field) -> how to compute it.
WIRE_VALUES: dict[tuple[type, str], Callable[[Any], object]] = {
    (GeneratedImage, "mime_type"): lambda image: image.image_format.mime_type,
    (ServerDescription, "family"): lambda info: _FAMILY_TO_PB.get(info.family, pb.MODEL_FAMILY_UNSPECIFIED),
}


def to_pb(record: object) -> Message:
    """A domain record as its message (MESSAGE_FOR_RECORD): each wire field from the record's field of that name,
    or as WIRE_VALUES computes it; None leaves an `optional` field unset; nested records become their messages."""
    message_class = MESSAGE_FOR_RECORD[type(record)]
    values = {}
    for descriptor in message_class.DESCRIPTOR.fields:
        compute = WIRE_VALUES.get((type(record), descriptor.name))
        value = compute(record) if compute is not None else getattr(record, descriptor.name)
        if value is None:
            continue
        if is_map(descriptor):
            value = dict(value)
        elif descriptor.message_type is not None:
            value = [to_pb(item) for item in value] if is_repeated(descriptor) else to_pb(value)
        elif is_repeated(descriptor):
            value = list(value)
        values[descriptor.name] = value
    return message_class(**values)


def generation_event_to_pb(event: GenerationEvent) -> pb.GenerateResponse:
    """A domain event -> one GenerateResponse (an image whole, however large; streams use generate_responses)."""
    if isinstance(event, Queued):
        return pb.GenerateResponse(queued=to_pb(event))
    if isinstance(event, StepProgress):
        return pb.GenerateResponse(progress=to_pb(event))
    if isinstance(event, GeneratedImage):
        return pb.GenerateResponse(image=to_pb(event))
    raise TypeError(f"not a generation event: {event!r}")


def generate_responses(event: GenerationEvent) -> list[pb.GenerateResponse]:
    """A domain event -> the GenerateResponse messages that carry it, none over MAX_GENERATE_RESPONSE_BYTES.

    Everything but an image is one message. An image too large for one is sent as the contract says: its
    bytes in order as `image_chunk` events of IMAGE_CHUNK_BYTES, then the `image` event with the metadata
    and the last piece (or nothing, when the last piece and the metadata do not fit together).
    """
    if not isinstance(event, GeneratedImage):
        return [generation_event_to_pb(event)]
    image = to_pb(event)
    if pb.GenerateResponse(image=image).ByteSize() <= MAX_GENERATE_RESPONSE_BYTES:
        return [pb.GenerateResponse(image=image)]
    data = image.data
    pieces = [data[start : start + IMAGE_CHUNK_BYTES] for start in range(0, len(data), IMAGE_CHUNK_BYTES)]
    image.data = pieces.pop()
    if pb.GenerateResponse(image=image).ByteSize() > MAX_GENERATE_RESPONSE_BYTES:
        pieces.append(image.data)
        image.data = b""
    return [pb.GenerateResponse(image_chunk=pb.ImageChunk(data=piece)) for piece in pieces] + [
        pb.GenerateResponse(image=image)
    ]


# ListAdapters pages. Their adapters take at most this many bytes: the 4 MiB any response may be
# (app.MAX_SEND_MESSAGE_BYTES) less room for the page's other fields (under 100 bytes), so a client that sends no
# page_size gets, in one page, every listing that fitted in one response before pages. An adapter's own entry is
# bounded by the model's slot layers (some 420 names for Flux, ~20 KB), far under it; a page always holds one.
ADAPTER_PAGE_BYTES = 4 * 1024 * 1024 - 16 * 1024
# Tokens name this process, so one made by another replica behind a front, or before a restart, is refused
# rather than read as an offset into a different cache.
_INSTANCE = secrets.token_hex(8)
_PAGE_TOKEN = re.compile(r"adapters:([0-9a-f]{16}):(\d{1,9})")


def adapter_page_to_pb(summary: AdapterCacheSummary, page_size: int, page_token: str) -> pb.ListAdaptersResponse:
    """One page of the cache listing: from the offset `page_token` names (the first page when empty), at most
    `page_size` adapters (0: no count limit) and at most ADAPTER_PAGE_BYTES of them, with the token of the next
    page when there is one. The token is opaque to clients: base64url of "adapters:INSTANCE:OFFSET"."""
    from loraswap.server.engine.errors import InvalidRequestError

    if page_size < 0:
        raise InvalidRequestError(
            f"page_size {page_size} is negative; use 0 for as many as fit in one response, or a positive size",
            field="page_size",
        )
    start = _page_offset(page_token)
    stop = len(summary.adapters) if page_size == 0 else start + page_size
    response = pb.ListAdaptersResponse(cache_bytes=summary.cache_bytes, cache_budget_bytes=summary.cache_budget_bytes)
    page_bytes = 0
    end = start
    for adapter in summary.adapters[start:stop]:
        info = to_pb(adapter)
        info_bytes = info.ByteSize() + 8  # with its field tag and length prefix
        if response.adapters and page_bytes + info_bytes > ADAPTER_PAGE_BYTES:
            break
        response.adapters.append(info)
        page_bytes += info_bytes
        end += 1
    if end < len(summary.adapters):
        response.next_page_token = base64.urlsafe_b64encode(f"adapters:{_INSTANCE}:{end}".encode()).decode()
    return response


def _page_offset(page_token: str) -> int:
    from loraswap.server.engine.errors import InvalidRequestError, shorten

    if not page_token:
        return 0
    try:
        match = _PAGE_TOKEN.fullmatch(base64.urlsafe_b64decode(page_token.encode("ascii")).decode("ascii"))
    except (ValueError, UnicodeError):
        match = None
    if match is None or match.group(1) != _INSTANCE:
        raise InvalidRequestError(
            f"page_token {shorten(page_token)!r} is not one this server process made (another replica's, or one "
            "from before a restart?); pass the next_page_token of the previous ListAdapters response from this "
            "server, or leave it empty to start again from the first page",
            field="page_token",
        )
    return int(match.group(2))
