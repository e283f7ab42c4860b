"""Base-model refusals through a real server, for each place an adapter may declare its base.

Every adapter here is the same PEFT-written tiny-flux LoRA, re-saved with safetensors' save_file and extra
metadata or given a model card (README.md front matter) beside it. The server serves tiny-flux, whose base is
black-forest-labs/FLUX.1-dev: adapters declaring SDXL, in any dialect, are refused with FAILED_PRECONDITION /
BASE_MODEL_MISMATCH before anything is loaded; those declaring FLUX.1 (or nothing) are served; a second
server started with --allow-base for SDXL accepts them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.servers import address_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
SDXL = "stabilityai/stable-diffusion-xl-base-1.0"
WEIGHTS = "pytorch_lora_weights.safetensors"


def _card(base_model: str) -> str:
    return f"---\nlicense: other\nbase_model: {base_model}\ntags:\n- lora\n---\n\n# A LoRA\n"


# name -> (extra safetensors metadata, README.md text or None)
MADE_FOR_SDXL = {
    "sdxl-base-model": ({"base_model": SDXL}, None),
    "sdxl-modelspec": ({"modelspec.architecture": "stable-diffusion-xl-v1-base/lora"}, None),
    "sdxl-kohya": ({"ss_base_model_version": "sdxl_base_v1-0"}, None),
    "sdxl-card": ({}, _card(SDXL)),
}
MADE_FOR_FLUX = {
    "flux-base-model": ({"base_model": FLUX_DEV}, None),
    "flux-modelspec": ({"modelspec.architecture": "Flux.1-dev/lora"}, None),
    "flux-kohya": ({"ss_base_model_version": "flux1"}, None),  # a family: any FLUX.1 model
    "schnell-card": ({}, _card("black-forest-labs/FLUX.1-schnell")),  # one group with FLUX.1-dev
    "plain": ({}, None),
}
# (adapter, source, the adapter_base reported)
REFUSALS = [
    ("sdxl-base-model", "safetensors:base_model", SDXL),
    ("sdxl-modelspec", "safetensors:modelspec.architecture", SDXL),
    ("sdxl-kohya", "safetensors:ss_base_model_version", SDXL),
    ("sdxl-card", "README.md:base_model", SDXL),
]


@pytest.fixture(scope="module")
def declaring_adapters(tmp_path_factory, flux_adapter_dir) -> Path:
    source = flux_adapter_dir / "r4-attn" / WEIGHTS
    tensors = load_file(source)
    with safe_open(source, "pt") as handle:
        metadata = handle.metadata() or {}
    root = tmp_path_factory.mktemp("declaring-adapters")
    for name, (extra, card) in {**MADE_FOR_SDXL, **MADE_FOR_FLUX}.items():
        (root / name).mkdir()
        save_file(tensors, str(root / name / WEIGHTS), metadata={**metadata, **extra})
        if card is not None:
            (root / name / "README.md").write_text(card)
    # The header declares SDXL and the tensors are cut off: refused for its base, so the tensors were never read.
    data = (root / "sdxl-base-model" / WEIGHTS).read_bytes()
    (root / "sdxl-cut").mkdir()
    (root / "sdxl-cut" / WEIGHTS).write_bytes(data[: len(data) // 2])
    (root / "long-declaration").mkdir()
    save_file(tensors, str(root / "long-declaration" / WEIGHTS), metadata={**metadata, "base_model": "x" * 5000})
    return root


@contextlib.asynccontextmanager
async def _stub(adapter_dir: Path, **engine) -> AsyncIterator[pb_grpc.DiffusionServiceStub]:
    # No compile and no warm-up: these tests are about which adapters get in, not about speed.
    async with (
        serving("tiny-flux", adapter_dir, compile=False, warmup=False, **engine) as running,
        grpc.aio.insecure_channel(address_of(running)) as channel,
    ):
        yield pb_grpc.DiffusionServiceStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stub(declaring_adapters):
    async with _stub(declaring_adapters) as stub:
        yield stub


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def allowing_stub(declaring_adapters):
    async with _stub(declaring_adapters, allow_base=("sdxl_base_v1-0",)) as stub:
        yield stub


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="a lighthouse", seed=3, num_inference_steps=2, width=64, height=64, **fields)


async def _image(stub, request: pb.GenerateRequest) -> pb.Image:
    async for response in stub.Generate(request, timeout=120):
        if response.WhichOneof("event") == "image":
            return response.image
    raise AssertionError("the stream ended without an image")


def _error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    (info,) = [
        info
        for detail in rpc_status.from_call(error).details
        for info in [error_details_pb2.ErrorInfo()]
        if detail.Unpack(info)
    ]
    return info


async def _cached(stub) -> set[str]:
    return {adapter.id for adapter in (await stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)).adapters}


async def test_server_info_reports_the_served_base(stub, allowing_stub) -> None:
    for each in (stub, allowing_stub):
        assert (await each.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)).base_model == FLUX_DEV


@pytest.mark.parametrize(("adapter", "source", "adapter_base"), REFUSALS, ids=[name for name, *_ in REFUSALS])
async def test_generate_refuses_an_adapter_for_another_base(stub, adapter, source, adapter_base) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _image(stub, _request(adapter=adapter))
    error = caught.value
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    info = _error_info(error)
    assert (info.reason, info.domain) == ("BASE_MODEL_MISMATCH", "loraswap")
    assert dict(info.metadata) == {"adapter_base": adapter_base, "served_base": FLUX_DEV, "source": source}
    assert adapter_base in error.details() and FLUX_DEV in error.details() and "--allow-base" in error.details()
    assert adapter not in await _cached(stub)


@pytest.mark.parametrize(("adapter", "source", "adapter_base"), REFUSALS, ids=[name for name, *_ in REFUSALS])
async def test_preload_refuses_an_adapter_for_another_base(stub, adapter, source, adapter_base) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.PreloadAdapter(pb.PreloadAdapterRequest(adapter=adapter), timeout=60)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert dict(_error_info(caught.value).metadata) == {
        "adapter_base": adapter_base, "served_base": FLUX_DEV, "source": source,
    }  # fmt: skip
    assert adapter not in await _cached(stub)


async def test_adapters_for_the_served_base_or_declaring_nothing_are_served(stub) -> None:
    images = {name: await _image(stub, _request(adapter=name)) for name in MADE_FOR_FLUX}
    # The same weights whatever they declare: the declaration only decides whether they get in.
    assert len({image.data for image in images.values()}) == 1
    assert set(MADE_FOR_FLUX) <= await _cached(stub)


async def test_a_refused_stack_member_leaves_the_resident_adapter_and_the_server_as_they_were(stub) -> None:
    before = await _image(stub, _request(adapter="plain"))
    stack = [pb.StackedAdapter(adapter="plain"), pb.StackedAdapter(adapter="sdxl-kohya")]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _image(stub, _request(adapters=stack))
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert _error_info(caught.value).reason == "BASE_MODEL_MISMATCH"
    info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert info.resident_adapter == "plain" and "sdxl-kohya" not in await _cached(stub)
    assert (await _image(stub, _request(adapter="plain"))).data == before.data


async def test_refused_from_the_header_alone(stub, allowing_stub) -> None:
    """A file whose tensors are cut off is refused for its base: nothing but the header was read."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _image(stub, _request(adapter="sdxl-cut"))
    assert _error_info(caught.value).reason == "BASE_MODEL_MISMATCH"
    # Where its base is allowed, reading the tensors finds the file broken.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _image(allowing_stub, _request(adapter="sdxl-cut"))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _error_info(caught.value).reason == "ADAPTER_MALFORMED"


async def test_allow_base_accepts_adapters_made_for_it(allowing_stub, stub) -> None:
    plain = await _image(stub, _request(adapter="plain"))
    for name in MADE_FOR_SDXL:
        assert (await _image(allowing_stub, _request(adapter=name))).data == plain.data, name


async def test_a_declaration_that_is_not_a_model_id_is_bad_metadata(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.PreloadAdapter(pb.PreloadAdapterRequest(adapter="long-declaration"), timeout=60)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _error_info(caught.value).reason == "ADAPTER_BAD_METADATA"
    assert len(caught.value.details()) < 1000  # the 5000-character value is not echoed back
