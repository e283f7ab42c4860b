"""Real servers on ports the OS picks, with real channels to them."""

from __future__ import annotations

import pytest_asyncio

from loraswap.client import AsyncLoraswapClient
from loraswap.engine.config import EngineConfig
from loraswap.server.app import start_server
from loraswap.server.config import Settings
from tests.conftest import TEST_TORCH_THREADS


def server_settings(model: str, adapter_dir, **engine) -> Settings:
    engine.setdefault("compile", True)
    engine.setdefault("compile_backend", "aot_eager")
    return Settings(
        engine=EngineConfig(
            model=model, adapter_dir=adapter_dir, max_rank=16, torch_threads=TEST_TORCH_THREADS, **engine
        ),
        host="127.0.0.1",
        port=0,
    )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def flux_server(flux_adapter_dir):
    running = await start_server(server_settings("tiny-flux", flux_adapter_dir))
    yield running
    await running.stop(1.0)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def sdxl_server(sdxl_adapter_dir):
    running = await start_server(server_settings("tiny-sdxl", sdxl_adapter_dir))
    yield running
    await running.stop(1.0)


@pytest_asyncio.fixture(loop_scope="session")
async def flux_client(flux_server):
    async with AsyncLoraswapClient(f"127.0.0.1:{flux_server.port}", default_timeout=120) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def sdxl_client(sdxl_server):
    async with AsyncLoraswapClient(f"127.0.0.1:{sdxl_server.port}", default_timeout=120) as client:
        yield client
