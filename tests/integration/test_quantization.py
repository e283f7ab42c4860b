"""--quantize on the CPU: torchao int8 weight-only on the `shapes` model, and what is refused.

The model still draws what the prompts say (base and every shipped adapter, scored by the pixel classifier on
the 90-prompt set), its denoiser's weights take at most 0.6x their unquantized bytes, the swap slot's LoRA
factors stay plain tensors in the model's dtype, and swaps under compile add no graph.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from loraswap.server.config import SettingsError
from loraswap.server.engine.adapters.formats import load_canonical
from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from loraswap.server.engine.pipeline.preflight import preflight
from loraswap.server.engine.pipeline.quantization import check_quantization
from loraswap.server.engine.pipeline.runtime import DiffusionRuntime
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.servers import TEST_TORCH_THREADS, address_of, client_of, serving

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from training.evaluate import score
from training.shapes_data import prompt_set

pytest.importorskip("torchao", reason="--quantize needs torchao, a dependency of loraswap-server")

MIN_ACCURACY = 0.9
MAX_WEIGHT_RATIO = 0.6
STYLES = ("outline", "swap-colors", "purple")


def _runtime(quantize: str, **engine) -> DiffusionRuntime:
    engine.setdefault("warmup", False)
    return start_runtime(
        EngineConfig(model="shapes", quantize=quantize, max_rank=16, torch_threads=TEST_TORCH_THREADS, **engine)
    )


def _shipped(runtime: DiffusionRuntime, style: str):
    path = shapes_adapter_dir() / style / "pytorch_lora_weights.safetensors"
    return load_canonical(AdapterFile(name=style, path=path, source=f"{style}/{path.name}"), runtime.slot_spec())


@pytest.fixture(scope="module")
def int8_runtime() -> DiffusionRuntime:
    return _runtime("int8wo")


def test_int8_weight_only_stores_the_denoiser_in_at_most_six_tenths_of_its_bytes(int8_runtime) -> None:
    plain = _runtime("none")
    ratio = int8_runtime.weights.denoiser_weight_bytes / plain.weights.denoiser_weight_bytes
    assert ratio <= MAX_WEIGHT_RATIO, f"int8wo denoiser is {ratio:.2f}x its float32 bytes"
    quantized = [name for name, p in int8_runtime.denoiser.named_parameters() if type(p) is not torch.nn.Parameter]
    assert quantized and all(".base_layer." in name or "lora_" not in name for name in quantized)
    # The slot's factors are never quantized: plain tensors in the model's dtype.
    for name, parameter in int8_runtime.denoiser.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            assert type(parameter) is torch.nn.Parameter and parameter.dtype == int8_runtime.loaded.dtype, name


def test_int8_weight_only_still_draws_what_prompts_say_with_every_shipped_adapter(int8_runtime) -> None:
    # Every third prompt, as test_shapes_server draws: 30 prompts, each shape 10 times, every color as shape and
    # as background.
    prompts = prompt_set()[::3]
    assert len(prompts) == 30
    results = {}
    with torch.inference_mode():
        for style in ("base", *STYLES):
            stack = () if style == "base" else ((_shipped(int8_runtime, style), 1.0),)
            int8_runtime.residency.load_stack(stack)
            results[style] = score(int8_runtime.loaded.pipe, style, prompts=prompts)["all"]
    assert all(accuracy >= MIN_ACCURACY for accuracy in results.values()), results


def test_fp8_is_refused_on_the_cpu_with_one_line() -> None:
    with pytest.raises(ValueError, match=r"--quantize fp8 needs a CUDA device .* use --quantize int8wo or none"):
        check_quantization("fp8", "cpu")
    with pytest.raises(SettingsError, match="fp8"):
        preflight(EngineConfig(quantize="fp8", device="cpu"))
    with pytest.raises(SettingsError, match="fp8"):  # start-up asks the pre-flight first, before anything loads
        start_runtime(EngineConfig(quantize="fp8", device="cpu"))
    with pytest.raises(ValueError, match="not one of none, int8wo, fp8"):
        check_quantization("int4", None)


def test_serve_refuses_fp8_on_the_cpu_before_loading_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--quantize", "fp8", "--device", "cpu"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--quantize fp8 needs a CUDA device" in lines[0], result.stderr
    bad_choice = subprocess.run(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--quantize", "int4"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad_choice.returncode == 2 and "invalid choice: 'int4'" in bad_choice.stderr


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def int8_server():
    """One compiled, warmed-up server with int8 weights and the shipped adapters, for the tests over gRPC."""
    async with serving("shapes", None, quantize="int8wo") as running:
        yield running


async def test_server_info_reports_quantization_and_stored_weight_bytes(int8_server) -> None:
    async with grpc.aio.insecure_channel(address_of(int8_server)) as channel:
        info = await pb_grpc.DiffusionServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest())
    assert info.quantization == "int8wo"
    assert 0 < info.denoiser_weight_bytes == int8_server.engine.describe().denoiser_weight_bytes


async def test_swaps_under_compile_add_no_graph_with_int8_weights(int8_server) -> None:
    async with client_of(int8_server) as client:
        info = await client.server_info()
        assert info.compiled and info.quantization == "int8wo"
        before = info.recompilations
        for style in (*STYLES, "base", "purple", "outline"):
            adapter = "" if style == "base" else style
            image = await client.generate_image(
                "a red circle on a blue background", adapter=adapter, adapter_scale=0.8 if adapter else None, seed=3
            )
            assert image.adapter == adapter
        assert (await client.server_info()).recompilations == before == 0
