"""Qwen-Image, Z-Image and FLUX.2 adapters in the layouts their trainers write, served like FLUX.1's: each family's
tiny model through real uncompiled servers.

For each family, files written here by hand from the model's own module names (tests/support/family_files.py):
diffusers' `transformer.…`, ComfyUI's and ai-toolkit's `diffusion_model.…`, DiffSynth's `.default.` infix, kohya's
and musubi-tuner's `lora_unet_…`, and the fused original names (FLUX.2's BFL `img_attn.qkv`/`linear1`, Z-Image's
`attention.qkv`). Each is served unfused and fused and equals diffusers' own `load_lora_weights` where diffusers
reads the file as it means, else its dense change merged by hand into plain diffusers' weights; a stack of them at
other strengths too, and what only a fused swap can apply (a rank over --max-rank, a layer outside the slot). A URL
serving a file (nginx, HTTPS with a CA made here) gives the bytes the same file gives from the adapter folder; the
`lora` call metadata alone gives the bytes the request field gives; two replicas give the same bytes, fused and
unfused; and wrong files are refused with FLUX.1's codes and reasons, changing nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from loraswap.client import LoraswapError
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.certificates import TestCertificateAuthority
from tests.support.family_cases import MODELS, FamilyModel
from tests.support.family_files import WEIGHTS, LayoutFile, WrittenFile, fused, layout_tensors, save_adapter, whole
from tests.support.images import MIN_ADAPTER_EFFECT, assert_images_close, decode
from tests.support.servers import address_of, client_of, serving
from tests.support.web_servers import NginxFileServer, require_nginx

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a paper boat on a pond"
SEED, STEPS = 9, 2
MAX_RANK = 8
# Every file's factors: N(0, STD), rank RANK, and ALPHA (not RANK, so a reader that ignored it would show) where the
# layout has alphas. Large enough to change the tiny models' images clearly.
RANK, ALPHA, STD = 4, 2.0, 1.0
QKV, ADDED_QKV = ("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj")

QWEN_LAYERS = whole(
    "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
    "transformer_blocks.1.img_mlp.net.0.proj", "transformer_blocks.0.img_mod.1",
)  # fmt: skip
Z_IMAGE_LAYERS = whole("layers.0.attention.to_k", "layers.1.feed_forward.w1", "noise_refiner.0.attention.to_out.0")
Z_IMAGE_FUSED = {
    **fused("layers.0.attention.qkv", "layers.0.attention", QKV),
    **fused("context_refiner.0.attention.qkv", "context_refiner.0.attention", QKV),
    "layers.1.attention.out": ("layers.1.attention.to_out.0",),
}  # fmt: skip
FLUX2_LAYERS = whole(
    "transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_v_proj", "transformer_blocks.0.ff.linear_in",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
)  # fmt: skip
FLUX2_BFL = {  # BFL's names of layers that are one diffusers layer each
    "double_blocks.0.img_mlp.0": ("transformer_blocks.0.ff.linear_in",),
    "double_blocks.1.txt_attn.proj": ("transformer_blocks.1.attn.to_add_out",),
    "single_blocks.0.linear2": ("single_transformer_blocks.0.attn.to_out",),
}  # fmt: skip
FLUX2_FUSED = {  # BFL's fused layers: qkv split by rows, linear1 whole (diffusers fuses it too)
    **fused("double_blocks.0.img_attn.qkv", "transformer_blocks.0.attn", QKV),
    **fused("double_blocks.1.txt_attn.qkv", "transformer_blocks.1.attn", ADDED_QKV),
    "single_blocks.1.linear1": ("single_transformer_blocks.1.attn.to_qkv_mlp_proj",),
    "double_blocks.0.img_attn.proj": ("transformer_blocks.0.attn.to_out.0",),
}  # fmt: skip

# family -> layout -> its file. diffusers_reads: whether diffusers' load_lora_weights reads the file as it means
# (checked against the ΔW made by hand through each pipeline's lora_state_dict): FLUX.2's kohya converter takes any
# lora_down file for BFL names and drops every other key (ComfyUI-style, diffusers-named kohya), its loader drops
# DiffSynth's unprefixed keys, and Z-Image's leaves a `diffusion_model.` qkv unsplit. Qwen-Image's original names
# are diffusers' own: it has no fused layer.
LAYOUT_FILES: dict[str, dict[str, LayoutFile]] = {
    "qwen-image": {
        "diffusers": LayoutFile("diffusers", QWEN_LAYERS, diffusers_reads=True),
        "comfyui": LayoutFile("comfyui", QWEN_LAYERS, diffusers_reads=True),
        "ai-toolkit": LayoutFile("ai-toolkit", QWEN_LAYERS, diffusers_reads=True),
        "diffsynth": LayoutFile("diffsynth", QWEN_LAYERS, diffusers_reads=True),
        "kohya": LayoutFile("kohya", QWEN_LAYERS, diffusers_reads=True),
    },
    "z-image": {
        "diffusers": LayoutFile("diffusers", Z_IMAGE_LAYERS, diffusers_reads=True),
        "comfyui": LayoutFile("comfyui", Z_IMAGE_LAYERS, diffusers_reads=True),
        "ai-toolkit": LayoutFile("ai-toolkit", Z_IMAGE_LAYERS, diffusers_reads=True),
        "diffsynth": LayoutFile("diffsynth", Z_IMAGE_LAYERS, diffusers_reads=True),
        "kohya": LayoutFile("kohya", Z_IMAGE_FUSED, diffusers_reads=True),  # musubi-tuner's original names
        "fused-qkv": LayoutFile("ai-toolkit", Z_IMAGE_FUSED, diffusers_reads=False),  # ComfyUI's original names
    },
    "flux2": {
        "diffusers": LayoutFile("diffusers", FLUX2_LAYERS, diffusers_reads=True),
        "comfyui": LayoutFile("comfyui", FLUX2_LAYERS, diffusers_reads=False),
        "ai-toolkit": LayoutFile("ai-toolkit", FLUX2_LAYERS, diffusers_reads=True),
        "diffsynth": LayoutFile("diffsynth", FLUX2_LAYERS, diffusers_reads=False),
        "kohya": LayoutFile("kohya", FLUX2_BFL, diffusers_reads=True),  # musubi-tuner's BFL names
        "fused-qkv": LayoutFile("comfyui", FLUX2_FUSED, diffusers_reads=False),  # ComfyUI's BFL names
    },
}
LAYOUT_NAMES = ("diffusers", "comfyui", "ai-toolkit", "diffsynth", "kohya", "fused-qkv")
# The file each family's URL, replica and refusal tests take (fused original names where the family has them).
SHOWCASE = {"qwen-image": "kohya", "z-image": "fused-qkv", "flux2": "fused-qkv"}
# A stack of two of each family's files at strengths other than 1.
STACK = {"qwen-image": [("comfyui", 0.7), ("kohya", -0.5)], "z-image": [("diffsynth", 0.7), ("fused-qkv", 0.5)],
         "flux2": [("kohya", 0.7), ("fused-qkv", 0.5)]}  # fmt: skip
# A file of a layer outside the slot's target layers, which only a fused swap applies: each family's input
# projection, in the family's ComfyUI spelling (FLUX.2's BFL `img_in` is diffusers' `x_embedder`; with FLUX.2's
# modulations, each one module every block of its stream shares, merged once). Beside it, "wide" is the showcase
# layout at a rank over --max-rank.
OUTSIDE = {
    "qwen-image": LayoutFile("comfyui", whole("img_in"), diffusers_reads=True),
    "z-image": LayoutFile("comfyui", whole("cap_embedder.1"), diffusers_reads=True),
    "flux2": LayoutFile("comfyui", {"img_in": ("x_embedder",),
                                    "double_stream_modulation_img.lin": ("double_stream_modulation_img.linear",),
                                    "single_stream_modulation.lin": ("single_stream_modulation.linear",)},
                        diffusers_reads=False),
}  # fmt: skip


# The down factor's key ends, in the layouts above.
DOWN_SUFFIXES = (".lora_A.weight", ".lora_A.default.weight", ".lora_down.weight")


class LayoutCase(FamilyModel):
    """One family's tiny model with its hand-written files, their meanings, and copies for the web server."""

    def __init__(self, model: str, root: Path, served: Path) -> None:
        super().__init__(model, root)
        self.specs = dict(LAYOUT_FILES[self.family])
        self.specs["outside"] = OUTSIDE[self.family]
        self.specs["wide"] = self.specs[SHOWCASE[self.family]]
        self.written: dict[str, WrittenFile] = {}
        for seed, (name, spec) in enumerate(self.specs.items(), start=1):
            rank = MAX_RANK + 4 if name == "wide" else RANK
            self.written[name] = layout_tensors(spec, self.denoiser, rank=rank, alpha=ALPHA, std=STD, seed=seed)
            save_adapter(self.written[name].tensors, self.adapters / name)
        self.showcase = SHOWCASE[self.family]
        self.url_path = f"/files/{model}/{self.showcase}.safetensors"
        (served / model).mkdir()
        shutil.copyfile(self.adapters / self.showcase / WEIGHTS, served / model / f"{self.showcase}.safetensors")
        self._write_refused_files()

    def _write_refused_files(self) -> None:
        """Files wrong in one way each, from the family's own: a factor one input wider than its layer (in diffusers'
        layout and the showcase's), a NaN. `widened` holds each wrong-shape file's layer as the file spells it."""
        self.widened: dict[str, str] = {}
        for layout in ("diffusers", self.showcase):
            tensors = dict(self.written[layout].tensors)
            down = next(key for key in sorted(tensors) if key.endswith(DOWN_SUFFIXES))
            tensors[down] = torch.cat([tensors[down], tensors[down][:, :1]], dim=1)
            save_adapter(tensors, self.adapters / f"wrong-shape-{layout}")
            suffix = next(suffix for suffix in DOWN_SUFFIXES if down.endswith(suffix))
            self.widened[f"wrong-shape-{layout}"] = down.removesuffix(suffix).removeprefix("transformer.")
        tensors = {key: value.clone() for key, value in self.written[self.showcase].tensors.items()}
        up = next(key for key in sorted(tensors) if key.endswith(("lora_B.weight", "lora_up.weight")))
        tensors[up][0, 0] = float("nan")
        save_adapter(tensors, self.adapters / "not-finite")

    def _assert_diffusers_reads(self, name: str) -> None:
        """diffusers' own reading of the file (its pipeline's lora_state_dict, alphas folded in) is the ΔW made by
        hand: where it is not, LAYOUT_FILES' diffusers_reads is out of date and the reference would be wrong."""
        converted = type(self.pipe).lora_state_dict(dict(self.written[name].tensors))
        theirs = {}
        for key, down in converted.items():
            if key.endswith(".lora_A.weight"):
                module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
                theirs[module] = converted[key.replace(".lora_A.", ".lora_B.")] @ down
        ours = self.written[name].deltas
        assert sorted(theirs) == sorted(ours), f"diffusers reads {name} as other layers"
        for module, delta in ours.items():
            torch.testing.assert_close(theirs[module], delta, rtol=1e-5, atol=1e-5, msg=f"{name}: {module}")

    def expected(self, members: list[tuple[str, float]], guidance: float) -> np.ndarray:
        """The image plain diffusers gives for these adapters at these strengths: its own loading where it reads
        every file, else their dense changes merged by hand."""
        options = dict(prompt=PROMPT, seed=SEED, steps=STEPS, guidance=guidance)
        if all(self.specs[name].diffusers_reads for name, _ in members):
            for name, _ in members:
                self._assert_diffusers_reads(name)
            if len(members) == 1:
                return self.reference.image(members[0][0], members[0][1], **options)
            return self.reference.stack_image(members, **options)
        deltas: dict[str, torch.Tensor] = {}
        for name, scale in members:
            for module, delta in self.written[name].deltas.items():
                deltas[module] = deltas.get(module, 0) + scale * delta
        return self.reference.merged_image(deltas, **options)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """What the web server serves: one file of each family, under the model's name."""
    return tmp_path_factory.mktemp("served")


@pytest.fixture(scope="module")
def ca() -> TestCertificateAuthority:
    return TestCertificateAuthority("loraswap family URL CA")


@pytest.fixture(scope="module")
def ca_file(ca, tmp_path_factory) -> Path:
    """The CA the servers trust for URLs, so that they start where there is no nginx (only the URL test skips)."""
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    path.write_bytes(ca.certificate_pem)
    return path


@pytest.fixture(scope="module")
def web(served, ca):
    require_nginx()
    with NginxFileServer(served, ca) as server:
        yield server


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory, served) -> LayoutCase:
    return LayoutCase(request.param, tmp_path_factory.mktemp(request.param), served)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(case, ca_file, tmp_path_factory):
    """--fuse auto, uncompiled (each request may pin either path), fetching from the test's web server."""
    async with serving(
        case.model, case.adapters, max_rank=MAX_RANK, fuse="auto", compile=False, allow_url_host=("127.0.0.1",),
        url_ca_file=ca_file, adapter_cache_dir=tmp_path_factory.mktemp("downloads"),
    ) as running:  # fmt: skip
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def unfusing_client(case):
    """A client of a server that never fuses (--fuse never): the slot alone must hold every adapter."""
    async with (
        serving(case.model, case.adapters, max_rank=MAX_RANK, fuse="never", compile=False) as running,
        client_of(running) as client,
    ):
        yield client


async def _image(client, **options):
    return await client.generate_image(PROMPT, seed=SEED, num_inference_steps=STEPS, **options)


async def _guidance(client) -> float:
    return (await client.server_info()).default_guidance_scale


async def _listed(client) -> set[str]:
    return {adapter.id for adapter in (await client.list_adapters()).adapters}


async def test_each_layout_served_unfused_and_fused_equals_its_reference(client, case):
    # Every layout the family's files come in (Qwen-Image has no fused layer: its original names are diffusers').
    layouts = list(LAYOUT_FILES[case.family])
    assert set(layouts) == set(LAYOUT_NAMES) - ({"fused-qkv"} if case.family == "qwen-image" else set())
    guidance = await _guidance(client)
    base = decode((await _image(client)).data)
    for name in layouts:
        expected = case.expected([(name, 1.0)], guidance)
        for fuse in ("unfused", "fused"):
            result = await _image(client, adapter=name, fuse=fuse)
            assert result.fused == (fuse == "fused"), name
            assert_images_close(decode(result.data), expected, name)
        assert np.abs(decode(result.data) - base).max() > MIN_ADAPTER_EFFECT, name  # the file really acts
        assert (await _image(client, adapter=name, fuse="fused")).data == result.data, name  # repeats bit for bit


async def test_a_stack_of_layouts_at_other_strengths_equals_its_reference(client, case):
    members = STACK[case.family]
    result = await _image(client, adapters=members)
    assert_images_close(decode(result.data), case.expected(members, await _guidance(client)))
    assert (await _image(client, adapters=members)).data == result.data


async def test_a_url_gives_the_image_of_the_same_file_from_the_adapter_folder(client, case, web):
    url = web.url(case.url_path)
    stack = [(case.showcase, 0.5), ("diffusers", 0.8)]
    for fuse in ("unfused", "fused"):
        local = await _image(client, adapter=case.showcase, fuse=fuse)
        fetched = await _image(client, adapter=url, fuse=fuse)
        assert fetched.data == local.data
        assert [entry.adapter for entry in fetched.adapters] == [url]
    local_stack = await _image(client, adapters=stack)
    fetched_stack = await _image(client, adapters=[(url, 0.5), ("diffusers", 0.8)])
    assert fetched_stack.data == local_stack.data
    assert url in await _listed(client)


def _raw_request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, seed=SEED, num_inference_steps=STEPS, width=64, height=64, **fields)


async def _raw_image(stub, request: pb.GenerateRequest, lora: str | None) -> pb.Image:
    metadata = [("lora", lora)] if lora is not None else None
    image = pb.Image()
    async for response in stub.Generate(request, metadata=metadata, timeout=120):
        if response.WhichOneof("event") == "image":
            image = response.image
    assert image.data, "the stream ended without an image"
    return image


def _reason(error: grpc.aio.AioRpcError) -> str:
    for detail in rpc_status.from_call(error).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


async def test_the_lora_metadata_alone_names_the_adapter_as_the_field_does(server, case):
    async with grpc.aio.insecure_channel(address_of(server)) as channel:
        stub = pb_grpc.DiffusionServiceStub(channel)
        by_field = await _raw_image(stub, _raw_request(adapter=case.showcase), None)
        by_metadata = await _raw_image(stub, _raw_request(), case.showcase)
        assert by_metadata.adapter == case.showcase and by_metadata.data == by_field.data
        members = [pb.StackedAdapter(adapter=name, scale=1.0) for name in ("diffsynth", "kohya")]
        stack_by_field = await _raw_image(stub, _raw_request(adapters=members), None)
        stack_by_metadata = await _raw_image(stub, _raw_request(), "kohya,diffsynth")
        assert stack_by_metadata.data == stack_by_field.data
        assert stack_by_metadata.data != by_metadata.data
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _raw_image(stub, _raw_request(adapter=case.showcase), "diffsynth")
        assert (refused.value.code(), _reason(refused.value)) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_MISMATCH")


async def test_two_replicas_give_the_same_bytes_fused_and_unfused(client, case):
    """The module's server (with the history of every test before this one) and a second one started now with the
    same flags give the same bytes for each request, on the path each pins or the server chooses. In float32 a
    fused and an unfused image of one file may have the same bytes, so the path is compared as each image reports
    it (bfloat16, where they differ, runs ten times slower on a CPU: test_same_bytes_on_every_replica.py uses it)."""
    requests = [
        {"adapter": case.showcase, "fuse": "unfused"}, {"adapter": case.showcase, "fuse": "fused"},
        {"adapter": "wide"}, {"adapters": STACK[case.family]}, {"adapter": case.showcase}, {},
    ]  # fmt: skip
    first = [await _image(client, **options) for options in requests]
    async with (
        serving(case.model, case.adapters, max_rank=MAX_RANK, fuse="auto", compile=False) as running,
        client_of(running) as replica,
    ):
        second = [await _image(replica, **options) for options in requests]
    for options, one, other in zip(requests, first, second, strict=True):
        assert (one.fused, one.data) == (other.fused, other.data), options
    assert [image.fused for image in first[:3]] == [False, True, True]


async def test_what_only_fusing_can_apply_is_served_fused_and_refused_unfused(client, case):
    guidance = await _guidance(client)
    for name, scale in (("wide", 0.5), ("outside", 1.0)):
        result = await _image(client, adapter=name, adapter_scale=scale)
        assert result.fused, name
        assert_images_close(decode(result.data), case.expected([(name, scale)], guidance))
        before = await _image(client, adapter="diffusers")
        with pytest.raises(LoraswapError) as refused:
            await _image(client, adapter=name, fuse="unfused")
        assert (refused.value.code, refused.value.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION, "FUSE_CHOICE_UNAVAILABLE"
        )  # fmt: skip
        assert "must_fuse" in refused.value.message
        assert (await _image(client, adapter="diffusers")).data == before.data


# (adapter, code, reason, what the message must say), as FLUX.1's tests expect each (test_adapter_store.py,
# test_hostile_inputs.py).
UNFUSED_REFUSALS = [
    ("wide", grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_RANK_TOO_HIGH", "--max-rank"),
    ("outside", grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_LAYER_NOT_TARGETED", "--target-modules"),
]
REFUSALS = [
    ("wrong-shape-diffusers", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_SHAPE_MISMATCH", "made for a different model"),
    ("wrong-shape-{showcase}", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_SHAPE_MISMATCH",
     "made for a different model"),
    ("not-finite", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_NOT_FINITE", "NaN"),
]  # fmt: skip


async def _assert_refused_changing_nothing(client, name: str, code, reason: str, *hints: str) -> None:
    before = await _image(client, adapter="diffusers")
    with pytest.raises(LoraswapError) as refused:
        await _image(client, adapter=name)
    assert (refused.value.code, refused.value.reason) == (code, reason), refused.value
    assert all(hint in refused.value.message for hint in hints), refused.value.message
    assert (await _image(client, adapter="diffusers")).data == before.data
    assert name not in await _listed(client)


@pytest.mark.parametrize(("name", "code", "reason", "hint"), UNFUSED_REFUSALS, ids=[r[0] for r in UNFUSED_REFUSALS])
async def test_a_server_that_never_fuses_refuses_what_its_slot_cannot_hold(unfusing_client, name, code, reason, hint):
    await _assert_refused_changing_nothing(unfusing_client, name, code, reason, hint)


@pytest.mark.parametrize(("name", "code", "reason", "hint"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_a_wrong_file_is_refused_and_changes_nothing(client, case, name, code, reason, hint):
    """A wrong-shape file's message also names the layer as the file spells it."""
    name = name.format(showcase=case.showcase)
    hints = (hint, case.widened[name]) if name in case.widened else (hint,)
    await _assert_refused_changing_nothing(client, name, code, reason, *hints)
