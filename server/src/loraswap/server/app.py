"""Builds and runs the grpc.aio server: servicer, health, reflection, signals, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraswap.server.config import Settings
from loraswap.server.engine.diffusion_engine import DiffusionEngine
from loraswap.server.transport.servicer import DiffusionServicer
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DiffusionService"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SHUTDOWN_FLUSH_S = 2.0


@dataclass
class RunningServer:
    """A started server: its port, and the parts that stop it."""

    server: grpc.aio.Server
    engine: DiffusionEngine
    health: health.aio.HealthServicer
    port: int
    warming: asyncio.Future | None = None  # set when start_server did not wait for SERVING

    async def stop(self, grace: float) -> None:
        """Health NOT_SERVING, refuse new work (UNAVAILABLE), let queued and running work finish
        within `grace` seconds, fail what is left with UNAVAILABLE, then stop."""
        await self.health.enter_graceful_shutdown()
        self.engine.stop_accepting()
        if not await self.engine.drain(grace):
            self.engine.abort_all(
                f"the server is shutting down and its {grace:g} s grace period ran out; retry on another replica"
            )
        # A moment for the aborted streams' statuses to reach their clients.
        await self.server.stop(SHUTDOWN_FLUSH_S)
        await self.engine.stop(timeout=SHUTDOWN_FLUSH_S)


async def start_server(settings: Settings, *, wait_until_serving: bool = True) -> RunningServer:
    """Listen at once (health NOT_SERVING), then load and warm the model and turn SERVING."""
    engine = DiffusionEngine(settings.engine)
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_DiffusionServiceServicer_to_server(DiffusionServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise OSError(f"could not listen on {settings.host}:{settings.port}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    running = RunningServer(server=server, engine=engine, health=health_servicer, port=port)

    async def become_serving() -> None:
        await engine.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on port %d", settings.engine.model, port)

    if wait_until_serving:
        await become_serving()
    else:
        running.warming = asyncio.ensure_future(become_serving())
    return running


async def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then drain gracefully."""
    running = await start_server(settings, wait_until_serving=False)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    print(f"loraswap: listening on port {running.port}, loading {settings.engine.model}", flush=True)
    stopping = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait([running.warming, stopping], return_when=asyncio.FIRST_COMPLETED)
    if running.warming.done() and running.warming.exception() is not None:
        await running.server.stop(0)
        raise running.warming.exception()
    if not stopping.done():
        print(f"loraswap: serving {settings.engine.model} on port {running.port}", flush=True)
        await stopping
    log.info("stopping: draining for up to %.0f s", settings.grace_seconds)
    await running.stop(settings.grace_seconds)
