"""Images of any size leave the server in messages of at most 1 MiB, and reassemble as the contract says."""

from __future__ import annotations

import os

import pytest

from loraswap.client.events import GeneratedImage as ClientImage
from loraswap.client.events import GenerateStreamDecoder
from loraswap.server.engine.types import GeneratedImage, ImageFormat, Queued, StepProgress, Timings
from loraswap.server.transport.convert import IMAGE_CHUNK_BYTES, MAX_GENERATE_RESPONSE_BYTES, generate_responses

MIB = 1024 * 1024


def _image(size: int, warnings: tuple[str, ...] = ("dropped 4 text-encoder layers",)) -> GeneratedImage:
    return GeneratedImage(
        data=os.urandom(size), image_format=ImageFormat.PNG, width=2048, height=2048, seed=7, adapter="ink",
        adapter_scale=0.8, timings=Timings(total_ms=12.0), warnings=warnings,
    )  # fmt: skip


def _reassembled(messages) -> bytes:
    """The contract's rule, written out: every image_chunk.data in order, then image.data."""
    pieces = [m.image_chunk.data for m in messages if m.WhichOneof("event") == "image_chunk"]
    return b"".join(pieces) + messages[-1].image.data


@pytest.mark.parametrize(
    ("size", "chunks"),
    [
        (0, 0),
        (1000, 0),
        (MIB - 4096, 0),  # fits with its metadata
        (MIB, 1),  # one byte too many for one message: one chunk, the rest in the image
        (IMAGE_CHUNK_BYTES, 0),
        (2 * IMAGE_CHUNK_BYTES, 1),
        (4 * MIB + 1, 4),
        (12 * MIB + 12345, 12),  # a noisy 2048x2048 PNG
    ],
)
def test_every_message_is_at_most_1_mib_and_the_bytes_reassemble(size: int, chunks: int) -> None:
    image = _image(size)
    messages = generate_responses(image)

    assert all(message.ByteSize() <= MAX_GENERATE_RESPONSE_BYTES == MIB for message in messages)
    assert [m.WhichOneof("event") for m in messages] == ["image_chunk"] * chunks + ["image"]
    assert _reassembled(messages) == image.data
    final = messages[-1].image
    assert (final.width, final.height, final.seed, final.adapter, list(final.warnings)) == (
        2048, 2048, 7, "ink", ["dropped 4 text-encoder layers"],
    )  # fmt: skip


def test_a_last_piece_that_does_not_fit_beside_long_metadata_goes_in_a_chunk_of_its_own() -> None:
    image = _image(2 * IMAGE_CHUNK_BYTES, warnings=("w" * 3000,))
    messages = generate_responses(image)

    assert [m.WhichOneof("event") for m in messages] == ["image_chunk", "image_chunk", "image"]
    assert messages[-1].image.data == b"" and _reassembled(messages) == image.data
    assert all(message.ByteSize() <= MAX_GENERATE_RESPONSE_BYTES for message in messages)


def test_the_client_decoder_joins_the_pieces_into_one_image() -> None:
    image = _image(5 * MIB + 3)
    decoder = GenerateStreamDecoder()
    events = [decoder.decode(message) for message in generate_responses(image)]

    *chunk_events, decoded = events
    assert chunk_events and all(event is None for event in chunk_events)
    assert isinstance(decoded, ClientImage) and decoded.data == image.data and decoded.seed == 7


def test_other_events_are_one_message_each() -> None:
    assert [m.WhichOneof("event") for m in generate_responses(Queued(position=2))] == ["queued"]
    (progress,) = generate_responses(StepProgress(step=1, total_steps=4, elapsed_ms=3.0))
    assert (progress.progress.step, progress.progress.total_steps) == (1, 4)
