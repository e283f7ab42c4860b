"""Real servers on ports the OS picks, with real channels to them."""

from __future__ import annotations

import pytest_asyncio

from loraswap.client import AsyncLoraswapClient
from loraswap.server.app import start_server
from tests.support.servers import server_settings


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
