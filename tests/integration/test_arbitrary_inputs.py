"""Property-based: arbitrary request field values and arbitrary adapter files against a real server.

Whatever hypothesis sends (GenerateRequest and PreloadAdapterRequest fields of any value the wire can carry,
and files of arbitrary bytes, mutated real adapters or made-up tensors and metadata, written into the adapter
directory and then preloaded and generated with), every answer is OK or one of the documented statuses with an
ErrorInfo reason from the vocabulary, never INTERNAL or UNKNOWN, and comes within a deadline; and the resident
model is unchanged: the base model's image stays bit-identical.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from loraswap.client import error_from_rpc
from loraswap.server.devtools.random_adapter import write_random_adapter
from loraswap.server.engine.errors import ErrorReason
from loraswap.server.engine.models import builtin_model
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.servers import address_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

GOOD = "good"
# The statuses the contract documents for bad input; INTERNAL, UNKNOWN and DEADLINE_EXCEEDED (a hang) are not.
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
DEADLINE_S = 30.0
MAX_SIZE = 64  # the server's --max-size, so that no valid request takes long
BASE = pb.GenerateRequest(prompt="a boat", seed=4, num_inference_steps=2)
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_file_numbers = itertools.count()

# -- strategies ---------------------------------------------------------------------------------------------

names = st.one_of(
    st.sampled_from(["", GOOD, "no-such", "../x", "/etc/passwd", "hf:owner/repo", "a" * 600, "d/" + "s" * 300]),
    st.text(max_size=40),
    st.text(alphabet="ab./-_:@\\ ", max_size=30),
)
optional_floats = st.one_of(st.none(), st.floats(width=32), st.sampled_from([-8.0, 0.0, 0.5, 8.0, 8.5]))
optional_int32 = st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1))
valid_sides = st.one_of(st.none(), st.sampled_from([8, 16, 32, MAX_SIZE]))
any_sides = st.one_of(st.integers(-8, MAX_SIZE + 8), optional_int32)
# Each field: a value the server accepts, or anything the wire can carry (which may happen to be valid too).
REQUEST_FIELDS = {
    "prompt": (st.sampled_from(["a boat", "a red circle"]), st.one_of(st.text(max_size=60), st.just("x" * 5000))),
    "negative_prompt": (st.just(""), st.text(max_size=20)),
    "adapter": (st.sampled_from(["", GOOD]), names),
    "adapter_scale": (st.one_of(st.none(), st.floats(-2, 2, width=32)), optional_floats),
    "num_inference_steps": (st.one_of(st.none(), st.integers(1, 3)), st.one_of(st.integers(-3, 4), optional_int32)),
    "guidance_scale": (st.one_of(st.none(), st.floats(0, 5, width=32)), optional_floats),
    "width": (valid_sides, any_sides),
    "height": (valid_sides, any_sides),
    "seed": (st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.one_of(st.none(), st.integers(0, 2**64 - 1))),
    "image_format": (st.sampled_from([0, 1, 2, 3]), st.integers(0, 6)),
    "adapters": (st.just([]), st.lists(st.builds(pb.StackedAdapter, adapter=names, scale=optional_floats), max_size=3)),
}  # fmt: skip


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A GenerateRequest whose fields are valid but for a few drawn at random (shrinks towards a valid request)."""
    wild = draw(st.sets(st.sampled_from(sorted(REQUEST_FIELDS)), max_size=4), label="arbitrary fields")
    fields = {name: draw(REQUEST_FIELDS[name][name in wild], label=name) for name in sorted(REQUEST_FIELDS)}
    return pb.GenerateRequest(**fields)


MODULES = [
    "transformer.transformer_blocks.0.attn.to_q",
    "transformer.single_transformer_blocks.1.attn.to_k",
    "transformer.transformer_blocks.0.norm1.linear",
    "lora_unet_double_blocks_0_img_attn_proj",
    "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
]
SUFFIXES = [".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight", ".alpha", ".bias", ""]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=20), inner, max_size=4)),
    max_leaves=12,
)
lora_config_keys = st.sampled_from(
    ["r", "lora_alpha", "alpha_pattern", "rank_pattern", "use_dora", "use_rslora", "init_lora_weights", "x"]
)


lora_configs = st.dictionaries(lora_config_keys.map(lambda key: f"transformer.{key}"), json_values, max_size=5)


@st.composite
def made_up_adapters(draw) -> bytes:
    """A well-formed safetensors file of made-up LoRA-like tensors and LoraConfig metadata."""
    tensors = {}
    for _ in range(draw(st.integers(1, 6))):
        module = draw(st.one_of(st.sampled_from(MODULES), st.text(max_size=30)))
        key = module + draw(st.sampled_from(SUFFIXES))
        shape = draw(st.lists(st.sampled_from([0, 1, 4, 32, 33]), max_size=3))
        scale = draw(st.sampled_from([0.0, 0.1, 1.0, 1e30, float("nan"), float("inf")]))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) * scale
        tensors[key] = values.to(draw(st.sampled_from(DTYPES)))
    metadata = None
    if draw(st.booleans()):
        metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(draw(lora_configs))}
    return save(tensors, metadata=metadata)


@st.composite
def mutated(draw, original: bytes) -> bytes:
    """A real adapter file with bytes overwritten, or (one time in four) cut short."""
    data = bytearray(original)
    for _ in range(draw(st.integers(0, 8))):
        position = draw(st.integers(0, len(data) - 1))
        data[position] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, 3)) == 0
    return bytes(data[: draw(st.integers(0, len(data)))]) if cut else bytes(data)


@st.composite
def relabelled(draw, original: bytes) -> bytes:
    """A real adapter's tensors under made-up LoraConfig metadata."""
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(draw(lora_configs))}
    return save(load(original), metadata=metadata)


# -- the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("arbitrary")
    write_random_adapter(builtin_model("tiny-flux").build(), root / GOOD, rank=4, seed=1, init_std=0.5)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stub(adapter_dir):
    async with (
        serving("tiny-flux", adapter_dir, compile=False, max_size=MAX_SIZE, max_adapter_bytes=1_000_000) as running,
        grpc.aio.insecure_channel(address_of(running)) as channel,
    ):
        yield pb_grpc.DiffusionServiceStub(channel)


@dataclass(frozen=True)
class BaseImage:
    """The base model's image taken first (kept out of hypothesis' reports of a failing example)."""

    data: bytes = field(repr=False)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def base_image(stub) -> BaseImage:
    return BaseImage(await _image(stub, BASE))


async def _image(stub, request: pb.GenerateRequest) -> bytes:
    data = b""
    async for response in stub.Generate(request, timeout=DEADLINE_S):
        if response.HasField("image_chunk"):
            data += response.image_chunk.data
        if response.HasField("image"):
            data += response.image.data
    return data


def _assert_documented(exc: grpc.aio.AioRpcError) -> None:
    assert exc.code() in DOCUMENTED, f"{exc.code()}: {exc.details()}"
    error = error_from_rpc(exc)
    assert error.reason in {reason.value for reason in ErrorReason}, error
    assert error.message


async def _answer(call, rpc: str) -> grpc.StatusCode:
    """Await a unary call or drain a stream; OK, or the documented status it failed with."""
    code = grpc.StatusCode.OK
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        _assert_documented(exc)
        code = exc.code()
    event(f"{rpc}: {code.name}")  # --hypothesis-show-statistics shows how the answers spread
    return code


async def _assert_model_unchanged(stub, base_image: BaseImage) -> None:
    assert await _image(stub, BASE) == base_image.data


# -- the properties -----------------------------------------------------------------------------------------


@SETTINGS
@given(request=generate_requests())
async def test_any_generate_request_gets_ok_or_a_documented_status(stub, base_image, request):
    await _answer(stub.Generate(request, timeout=DEADLINE_S), "Generate")
    await _assert_model_unchanged(stub, base_image)


@settings(SETTINGS, max_examples=25)
@given(name=names)
async def test_any_preload_request_gets_ok_or_a_documented_status(stub, base_image, name):
    await _answer(stub.PreloadAdapter(pb.PreloadAdapterRequest(adapter=name), timeout=DEADLINE_S), "PreloadAdapter")
    await _assert_model_unchanged(stub, base_image)


@SETTINGS
@given(data=st.data())
async def test_any_adapter_file_gets_ok_or_a_documented_status(stub, base_image, adapter_dir, data):
    original = (adapter_dir / GOOD / "pytorch_lora_weights.safetensors").read_bytes()
    files = st.one_of(st.binary(max_size=512), mutated(original), made_up_adapters(), relabelled(original))
    content = data.draw(files, label="file")
    name = f"arbitrary-{next(_file_numbers)}"
    (adapter_dir / f"{name}.safetensors").write_bytes(content)
    preload = stub.PreloadAdapter(pb.PreloadAdapterRequest(adapter=name), timeout=DEADLINE_S)
    preloaded = await _answer(preload, "PreloadAdapter")
    request = pb.GenerateRequest(prompt="a boat", seed=4, num_inference_steps=2, adapter=name)
    await _answer(stub.Generate(request, timeout=DEADLINE_S), "Generate")
    if preloaded == grpc.StatusCode.OK:
        await _answer(stub.Evict(pb.EvictRequest(adapter=name), timeout=DEADLINE_S), "Evict")
    await _assert_model_unchanged(stub, base_image)
