"""Any client can receive any image: an image over 4 MiB reaches clients whose receive limit is gRPC's default
4 MiB, in messages of at most 1 MiB, through the Python client and through the reflection-only JSON path that
grpcurl users take.

The default run serves a scripted engine through the real server (the transport is what is under test: the
servicer's chunking, the server's options, reflection); the built-in model makes such an image only where it
is quick, on a GPU (on CPU the tiny models' VAE attention takes minutes at 1280x1280).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from PIL import Image

from loraswap.client import GeneratedImage
from tests.support.engines import ScriptedEngine, noise_png, one_step
from tests.support.servers import address_of, client_of, scripted_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

MIB = 1024 * 1024
DEFAULT_RECEIVE_LIMIT = 4 * MIB
SIDE = 1280  # a noisy 1280x1280 PNG is about 4.7 MiB
SEED = 11


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def scripted_server():
    async with serving(scripted_settings(), engine=ScriptedEngine(one_step)) as running:
        yield running


async def test_the_python_client_with_default_options_receives_the_whole_image(scripted_server) -> None:
    expected = noise_png(SIDE, SIDE, SEED)
    assert len(expected) > DEFAULT_RECEIVE_LIMIT

    async with client_of(scripted_server, default_timeout=60) as client:
        image = await client.generate_image("noise", width=SIDE, height=SIDE, seed=SEED)

    assert isinstance(image, GeneratedImage) and image.data == expected
    assert (image.width, image.height, image.seed, image.warnings) == (SIDE, SIDE, SEED, ("scripted",))


def _generate_over_reflection(target: str, request_json: dict, credentials=None) -> tuple[list[int], list[dict]]:
    """What grpcurl does: a channel with default options, message types only from the server's reflection service,
    JSON in and out. Returns each response's size on the wire and the responses as JSON."""
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName("loraswap.v1.DiffusionService").methods_by_name["Generate"]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(json.dumps(request_json), request_class())
        # No response deserializer: the raw bytes, to measure each message as it crossed the wire.
        stream = channel.unary_stream(
            "/loraswap.v1.DiffusionService/Generate", request_serializer=request_class.SerializeToString
        )
        raw_responses = list(stream(request, timeout=60))
    return [len(raw) for raw in raw_responses], [
        json_format.MessageToDict(response_class.FromString(raw)) for raw in raw_responses
    ]


def reassemble(events: list[dict]) -> bytes:
    """The proto's rule, as a JSON user applies it: every imageChunk.data in order, then image.data."""
    pieces = [base64.b64decode(event["imageChunk"].get("data", "")) for event in events if "imageChunk" in event]
    return b"".join(pieces) + base64.b64decode(events[-1]["image"].get("data", ""))


async def test_the_reflection_json_path_receives_the_image_in_pieces_of_at_most_1_mib(scripted_server) -> None:
    request = {"prompt": "noise", "width": SIDE, "height": SIDE, "seed": str(SEED)}
    sizes, events = await asyncio.to_thread(_generate_over_reflection, address_of(scripted_server), request)

    assert max(sizes) <= MIB, sizes
    kinds = [next(iter(event)) for event in events]
    assert kinds[0] == "progress" and kinds[-1] == "image" and set(kinds[1:-1]) == {"imageChunk"}
    assert len(kinds[1:-1]) == len(noise_png(SIDE, SIDE, SEED)) // MIB  # as many pieces as needed, no more
    data = reassemble(events)
    assert data == noise_png(SIDE, SIDE, SEED) and len(data) > DEFAULT_RECEIVE_LIMIT
    assert Image.open(io.BytesIO(data)).size == (SIDE, SIDE)
    assert (events[-1]["image"]["width"], events[-1]["image"]["seed"]) == (SIDE, str(SEED))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.skipif(not _cuda_available(), reason="a 1280x1280 image from a built-in model takes minutes on CPU")
async def test_a_built_in_model_image_over_4_mib_reaches_default_clients(flux_adapter_dir) -> None:
    async with serving("tiny-flux", flux_adapter_dir, compile=False, device="cuda", max_size=SIDE) as running:
        target = address_of(running)
        async with client_of(running, default_timeout=300) as client:
            image = await client.generate_image("a red circle", width=SIDE, height=SIDE, num_inference_steps=1, seed=1)
        assert len(image.data) > DEFAULT_RECEIVE_LIMIT
        request = {"prompt": "a red circle", "width": SIDE, "height": SIDE, "numInferenceSteps": 1, "seed": "1"}
        sizes, events = await asyncio.to_thread(_generate_over_reflection, target, request)
        assert max(sizes) <= MIB and reassemble(events) == image.data
