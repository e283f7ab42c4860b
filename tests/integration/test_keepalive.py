"""A Generate stream that stays quiet for over a minute (waiting in the queue) is neither cut nor answered with
GOAWAY `too_many_pings`: the client's keepalive pings every 20 s and the server accepts them.

The same client against a server with gRPC's default ping policy (a client may ping every 5 minutes) runs
alongside as the control: it does get `too_many_pings` within the minute, so the client's pings are real and
the server's settings are what let them through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from loraswap.client import AsyncLoraswapClient, GeneratedImage, Progress, Queued, Unavailable
from loraswap.client.connection import CLIENT_KEEPALIVE_TIME_MS
from loraswap.server.engine import types as engine_types
from loraswap.server.engine.types import GenerationEvent, GenerationRequest, StepProgress
from loraswap.server.transport.servicer import DiffusionServicer, add_diffusion_service
from tests.support.engines import ScriptedEngine, finished_image
from tests.support.servers import client_of, scripted_settings, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Long enough for three client pings (at 20, 40 and 60 s), which a default server answers with GOAWAY.
QUIET_S = 65.0


async def waits_in_the_queue(request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
    """Queued, then nothing on the stream for QUIET_S, then one step and the image."""
    yield engine_types.Queued(position=1)
    await asyncio.sleep(QUIET_S)
    yield StepProgress(step=1, total_steps=1, elapsed_ms=1.0)
    yield finished_image(b"\x89PNG quiet", request, 64, 64)


async def _events(client: AsyncLoraswapClient) -> list[object]:
    async with client:
        return [event async for event in client.generate("a patient request", seed=1)]


async def test_a_quiet_minute_long_stream_is_kept_alive_and_not_refused_for_its_pings() -> None:
    assert 3 * CLIENT_KEEPALIVE_TIME_MS / 1000 < QUIET_S  # the control below depends on three pings
    options = dict(default_timeout=QUIET_S + 60, wait_for_ready=False)
    async with serving(scripted_settings(), engine=ScriptedEngine(waits_in_the_queue)) as running:
        # The control: the same servicer on a server with gRPC's default options.
        default_server = grpc.aio.server()
        add_diffusion_service(DiffusionServicer(ScriptedEngine(waits_in_the_queue)), default_server)
        default_port = default_server.add_insecure_port("127.0.0.1:0")
        await default_server.start()
        try:
            started = time.monotonic()
            served, control = await asyncio.gather(
                _events(client_of(running, **options)),
                _events(AsyncLoraswapClient(f"127.0.0.1:{default_port}", **options)),
                return_exceptions=True,
            )
            elapsed_s = time.monotonic() - started
        finally:
            await default_server.stop(None)

    assert not isinstance(served, BaseException), f"the quiet stream failed: {served!r}"
    assert [type(event) for event in served] == [Queued, Progress, GeneratedImage] and elapsed_s >= QUIET_S
    assert isinstance(control, Unavailable) and "ping" in control.message.lower(), repr(control)
