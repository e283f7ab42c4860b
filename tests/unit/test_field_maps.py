"""Every field of every reply message has a counterpart in the engine's record and in the client's class.

Both conversions are built from field names (transport/convert.py `to_pb`, the client's `_from_message`), with
small tables for what is spelled or typed differently. A field added to the contract but to neither side, or
dropped from one of them, fails here instead of vanishing on the wire (as six GetServerInfo fields once did).
"""

from __future__ import annotations

import dataclasses

import pytest

from loraswap.client import events as client_events
from loraswap.server.engine import types as engine_types
from loraswap.server.transport import convert
from loraswap.v1 import diffusion_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["DiffusionService"]
# Reply fields that belong to the transport alone: the stream's envelope, its image pieces, the paging.
TRANSPORT_ONLY = {
    "loraswap.v1.GenerateResponse": {"queued", "progress", "image", "image_chunk"},
    "loraswap.v1.ImageChunk": {"data"},
    "loraswap.v1.ListAdaptersResponse": {"next_page_token"},
}
# Replies whose fields are plain values of an engine method, not of a record (EvictResponse: the bytes freed).
PLAIN_REPLIES = {"loraswap.v1.EvictResponse"}
# Replies assembled page by page, whose records are converted whole (ListAdaptersResponse holds AdapterInfo).
PAGED = {"loraswap.v1.ListAdaptersResponse": (engine_types.AdapterCacheSummary, client_events.AdapterList)}


def _reply_messages() -> set[str]:
    """Every message a DiffusionService reply holds, nested ones included (requests' own types excluded)."""
    found: set[str] = set()
    pending = [method.output_type for method in SERVICE.methods]
    while pending:
        message = pending.pop()
        if message.full_name in found:
            continue
        found.add(message.full_name)
        # A map's entries are plain keys and values, converted as a dict on both sides (wire.is_map).
        pending += [field.message_type for field in message.fields
                    if field.message_type is not None and not field.message_type.GetOptions().map_entry]  # fmt: skip
    return found


def unmatched_engine_fields(record: type, message) -> set[str]:
    """The wire fields of `message` that `to_pb` would find no value for in `record`."""
    names = {item.name for item in dataclasses.fields(record)}
    computed = {wire for (owner, wire) in convert.WIRE_VALUES if owner is record}
    return {field.name for field in message.DESCRIPTOR.fields} - names - computed


def unmatched_client_fields(cls: type, message) -> set[str]:
    """The wire fields of `message` that no field of the client's `cls` reads."""
    read = {client_events.WIRE_NAMES.get((cls, item.name), item.name) for item in dataclasses.fields(cls)}
    return {field.name for field in message.DESCRIPTOR.fields} - read


def test_every_reply_message_is_mapped_on_both_sides() -> None:
    engine_side = {message.DESCRIPTOR.full_name for message in convert.MESSAGE_FOR_RECORD.values()}
    client_side = set(client_events.CLASS_FOR_MESSAGE)
    for name in _reply_messages() - set(TRANSPORT_ONLY) - PLAIN_REPLIES - set(PAGED):
        assert name in engine_side, f"{name}: no engine record in convert.MESSAGE_FOR_RECORD"
        assert name in client_side, f"{name}: no client class in events.CLASS_FOR_MESSAGE"


@pytest.mark.parametrize("record", list(convert.MESSAGE_FOR_RECORD), ids=lambda record: record.__name__)
def test_every_wire_field_has_an_engine_counterpart(record: type) -> None:
    assert unmatched_engine_fields(record, convert.MESSAGE_FOR_RECORD[record]) == set()


@pytest.mark.parametrize(
    "name", sorted(client_events.CLASS_FOR_MESSAGE), ids=lambda name: name.removeprefix("loraswap.v1.")
)
def test_every_wire_field_has_a_client_counterpart(name: str) -> None:
    cls = client_events.CLASS_FOR_MESSAGE[name]
    message = next(m for m in convert.MESSAGE_FOR_RECORD.values() if m.DESCRIPTOR.full_name == name)
    assert unmatched_client_fields(cls, message) == set()


def test_the_paged_listing_has_counterparts_too() -> None:
    record, cls = PAGED["loraswap.v1.ListAdaptersResponse"]
    wire = {field.name for field in pb.ListAdaptersResponse.DESCRIPTOR.fields}
    transport = TRANSPORT_ONLY["loraswap.v1.ListAdaptersResponse"]
    assert wire - transport == {item.name for item in dataclasses.fields(record)}
    assert wire - transport == {item.name for item in dataclasses.fields(cls)}


def test_a_dropped_field_is_caught() -> None:
    """The checks above can fail: a ServerInfo without `quantization` is reported, as is a record without it."""
    fields = [(item.name, item.type, item) for item in dataclasses.fields(client_events.ServerInfo)]
    shortened = dataclasses.make_dataclass(
        "ServerInfo", [(name, kind, item) for name, kind, item in fields if name != "quantization"]
    )
    assert unmatched_client_fields(shortened, pb.GetServerInfoResponse) == {"quantization"}
    record_fields = [(item.name, item.type, item) for item in dataclasses.fields(engine_types.ServerDescription)]
    shortened_record = dataclasses.make_dataclass(
        "ServerDescription", [(name, kind, item) for name, kind, item in record_fields if name != "base_model"]
    )
    assert unmatched_engine_fields(shortened_record, pb.GetServerInfoResponse) == {"base_model"}


def test_server_info_round_trips_every_field() -> None:
    """A description with every field set reaches the client's ServerInfo whole (family as its name)."""
    description = engine_types.ServerDescription(
        model="m", family=engine_types.ModelFamily.SDXL, dtype="bfloat16", device="cuda:0", max_rank=32,
        target_layers=("a", "b"), compiled=True, recompilations=3, resident_adapter="ink", size_multiple=8,
        min_size=64, max_size=1024, default_width=512, default_height=768, default_num_inference_steps=20,
        default_guidance_scale=5.5, resident_adapters=("ink",), max_stack=3, base_model="org/base",
        quantization="int8wo", denoiser_weight_bytes=123, attention_backend="_flash_3", pinned_adapter_memory=True,
        device_adapter_bytes=456, compile_mode="full/default", rank_buckets=(16, 32),
    )  # fmt: skip
    info = client_events.ServerInfo.from_pb(convert.to_pb(description))
    expected = {item.name: getattr(description, item.name) for item in dataclasses.fields(client_events.ServerInfo)}
    expected["family"] = "sdxl"
    assert dataclasses.asdict(info) == expected
