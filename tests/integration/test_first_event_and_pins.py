"""The stream from its first moment, and adapters preloaded (--preload) and pinned (--pin) before SERVING.

A real server on port 0 serving `shapes`, whose adapter directory is read through a source made slow on
purpose: finding a name in `SlowAdapterDirectory.slow` takes SLOW_S, as from a cold network store, so a cold
load lasts well over the 100 ms in which the first event must arrive.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import pytest_asyncio

from loraswap.client import AsyncLoraswapClient, GeneratedImage, LoraswapError, Progress, Queued
from loraswap.server.engine.adapters.sources import AdapterFile, AdapterSources, HubAdapterSource, LocalAdapterDirectory
from loraswap.server.engine.diffusion_engine import DiffusionEngine
from loraswap.server.engine.errors import StartupError
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from tests.support.servers import client_of, server_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

SLOW_S = 1.5
FIRST_EVENT_S = 0.1  # the bound: the first event within 100 ms of the call
PROMPT = "a red circle on a blue background"


class SlowAdapterDirectory(LocalAdapterDirectory):
    """The adapter directory, where finding a name in `slow` takes `delay_s`; records when each find ended."""

    def __init__(self, root: Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.slow: set[str] = set()
        self.found_at: dict[str, float] = {}

    def find(self, name: str) -> AdapterFile | None:
        if name in self.slow:
            time.sleep(self.delay_s)
        found = super().find(name)
        self.found_at[name] = time.perf_counter()
        return found


def _engine(directory: LocalAdapterDirectory, **config) -> DiffusionEngine:
    settings = server_settings("shapes", shapes_adapter_dir(), compile=False, **config)
    return DiffusionEngine(settings.engine, sources=AdapterSources(directory, HubAdapterSource(False)))


@pytest.fixture(scope="module")
def slow_dir() -> SlowAdapterDirectory:
    return SlowAdapterDirectory(shapes_adapter_dir(), SLOW_S)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(slow_dir):
    settings = server_settings("shapes", shapes_adapter_dir(), compile=False, pin=("outline",), preload=("purple",))
    engine = _engine(slow_dir, pin=("outline",), preload=("purple",))
    async with serving(settings, engine=engine) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def client(server):
    async with client_of(server) as client:
        await client.server_info()  # the channel is connected before anything is timed
        yield client


async def _timed_events(client: AsyncLoraswapClient, adapter: str) -> tuple[float, list[tuple[float, object]]]:
    started = time.perf_counter()
    events = [
        (time.perf_counter(), event)
        async for event in client.generate(PROMPT, adapter=adapter, seed=1, num_inference_steps=2)
    ]
    return started, events


async def test_pinned_and_preloaded_adapters_are_cached_before_serving(client) -> None:
    listing = {adapter.id: adapter for adapter in (await client.list_adapters()).adapters}
    assert set(listing) == {"outline", "purple"}  # nobody asked for them: start-up loaded them
    assert listing["outline"].pinned and not listing["purple"].pinned
    assert listing["outline"].hits == listing["purple"].hits == 0


async def test_first_event_of_a_cold_adapter_arrives_while_it_loads(client, slow_dir) -> None:
    slow_dir.slow.add("swap-colors")
    started, events = await _timed_events(client, "swap-colors")
    first_at, first = events[0]
    assert first == Queued(position=0, loading_adapter=True)
    assert first_at - started < FIRST_EVENT_S, f"first event after {(first_at - started) * 1000:.0f} ms"
    assert first_at < slow_dir.found_at["swap-colors"], "the first event waited for the adapter's load"
    # Then the queue position as usual, the steps, and the image with the adapter applied.
    kinds = [type(event) for _, event in events]
    assert events[1][1] == Queued(position=1, loading_adapter=False)
    assert kinds[2:] == [Progress, Progress, GeneratedImage]
    image = events[-1][1]
    assert image.adapter == "swap-colors" and image.timings.total_ms >= SLOW_S * 1000


@pytest.mark.parametrize("adapter", ["outline", ""], ids=["cached", "base"])
async def test_first_event_without_a_load_is_the_queue_position_at_once(client, adapter: str) -> None:
    started, events = await _timed_events(client, adapter)
    first_at, first = events[0]
    assert first == Queued(position=1, loading_adapter=False)
    assert first_at - started < FIRST_EVENT_S, f"first event after {(first_at - started) * 1000:.0f} ms"
    assert isinstance(events[-1][1], GeneratedImage) and events[-1][1].adapter == adapter


async def test_evict_refuses_a_pinned_adapter_and_frees_a_preloaded_one(client) -> None:
    with pytest.raises(LoraswapError) as refused:
        await client.evict("outline")
    assert (refused.value.code.name, refused.value.reason) == ("FAILED_PRECONDITION", "ADAPTER_PINNED")
    assert refused.value.metadata["adapter"] == "outline" and "--pin" in refused.value.message
    assert await client.evict("purple") > 0
    listing = {adapter.id: adapter for adapter in (await client.list_adapters()).adapters}
    assert listing["outline"].pinned and "purple" not in listing


async def test_pins_beyond_the_cache_budget_stop_start_up() -> None:
    engine = _engine(LocalAdapterDirectory(shapes_adapter_dir()), pin=("outline",), adapter_cache_bytes=1024)
    with pytest.raises(StartupError) as refused:
        await engine.start()
    message = str(refused.value)
    assert message.startswith("--pin 'outline': ") and "--adapter-cache-bytes" in message and "\n" not in message
    assert not engine.serving
