"""The GPU-only options on a CPU server: accepted, reported inactive by GetServerInfo, and serving as before.

--attention names a backend that needs CUDA and --device-adapter-bytes a hot set on the device; on the CPU the
native attention runs, adapters are copied from ordinary host memory, and GetServerInfo says so
(attention_backend "native", pinned_adapter_memory false, device_adapter_bytes 0) while swaps still work.
An unknown backend stops `loraswap serve` with one line and exit code 2.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import pytest

from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from tests.support.servers import address_of, server_settings, serving


@pytest.mark.asyncio(loop_scope="session")
async def test_cpu_server_accepts_gpu_options_and_reports_them_inactive(flux_adapter_dir, caplog):
    settings = server_settings(
        "tiny-flux", flux_adapter_dir, compile=False, device="cpu", attention="flash", device_adapter_bytes=1 << 30
    )
    with caplog.at_level(logging.INFO, logger="loraswap.server.engine"):
        async with serving(settings) as running, grpc.aio.insecure_channel(address_of(running)) as channel:
            stub = pb_grpc.DiffusionServiceStub(channel)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            request = pb.GenerateRequest(prompt="a lighthouse", adapter="r4-attn", seed=1, num_inference_steps=2)
            events = [event async for event in stub.Generate(request)]
            after = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert (info.device, info.attention_backend) == ("cpu", "native")
    assert info.pinned_adapter_memory is False and info.device_adapter_bytes == 0
    assert events[-1].WhichOneof("event") == "image" and events[-1].image.adapter == "r4-attn"
    assert after.resident_adapter == "r4-attn"
    assert running.engine.runtime.residency.device_cache is None  # no hot set: copies come from the host
    messages = [record.getMessage() for record in caplog.records]
    assert "--attention flash needs CUDA; cpu runs the native backend (torch SDPA)" in messages
    assert any(
        message.startswith("--device-adapter-bytes: adapters are copied from host memory") for message in messages
    )


def test_serve_refuses_an_unknown_attention_backend_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--attention", "warp-drive", "--port", "0"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "--attention 'warp-drive' is not an attention backend; use one of" in lines[0]
    assert "native" in lines[0] and "_flash_3" in lines[0]
