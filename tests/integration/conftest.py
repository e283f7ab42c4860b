"""Real servers on ports the OS picks, with real channels to them."""

from __future__ import annotations

import pytest_asyncio

from tests.support.servers import client_of, serving


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def flux_server(flux_adapter_dir):
    async with serving("tiny-flux", flux_adapter_dir) as running:
        yield running


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def sdxl_server(sdxl_adapter_dir):
    async with serving("tiny-sdxl", sdxl_adapter_dir) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def flux_client(flux_server):
    async with client_of(flux_server) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def sdxl_client(sdxl_server):
    async with client_of(sdxl_server) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def client(server):
    """A client to the module's own `server` fixture (a server started with what that module tests)."""
    async with client_of(server) as client:
        yield client
