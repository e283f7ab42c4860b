"""Builds and runs the grpc.aio server: servicer, health, reflection, TLS, tokens, signals, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraswap.client.connection import server_keepalive_options
from loraswap.server.access import AccessTokens
from loraswap.server.config import Settings, SettingsError
from loraswap.server.engine.diffusion_engine import DiffusionEngine
from loraswap.server.engine.interface import Engine
from loraswap.server.observability.observers import ServerObservers
from loraswap.server.transport.call_watch import CallWatchInterceptor
from loraswap.server.transport.server_credentials import ReloadableServerCredentials
from loraswap.server.transport.servicer import DiffusionServicer, add_diffusion_service
from loraswap.server.transport.token_auth import TokenAuthInterceptor
from loraswap.v1 import diffusion_service_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DiffusionService"].full_name
# Requests are small (prompts of a few thousand characters, adapter names); a bigger one is refused with
# RESOURCE_EXHAUSTED before it is buffered.
MAX_RECEIVE_MESSAGE_BYTES = 256 * 1024
# Generate sends images in pieces of at most 1 MiB and ListAdapters pages of at most this less 16 KiB
# (transport/convert.py); nothing may exceed the 4 MiB every gRPC client accepts by default, so a response that
# would fails here, not in the client.
MAX_SEND_MESSAGE_BYTES = 4 * 1024 * 1024
SHUTDOWN_FLUSH_S = 2.0


@dataclass
class RunningServer:
    """A started server: its port, and the parts that stop it."""

    server: grpc.aio.Server
    engine: Engine
    health: health.aio.HealthServicer
    port: int
    warming: asyncio.Future | None = None  # set when start_server did not wait for SERVING
    credentials: ReloadableServerCredentials | None = None  # with --tls-cert
    tokens: AccessTokens | None = None  # with --auth-token-file
    observers: ServerObservers | None = None  # metrics, access log, traces
    metrics_port: int | None = None  # where /metrics is served (with --metrics-port; the bound port when 0)

    def reload_credentials(self) -> None:
        """Re-read the TLS files and the token file (on SIGHUP); whatever is unusable keeps its previous contents."""
        for name, reloadable in (("TLS certificate", self.credentials), ("token file", self.tokens)):
            if reloadable is None:
                continue
            try:
                reloadable.reload()
            except SettingsError as error:
                log.error("kept the previous %s: %s", name, error)
            else:
                log.info("reloaded the %s", name)

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
        if self.observers is not None:
            await asyncio.to_thread(self.observers.close)


async def start_server(
    settings: Settings, *, wait_until_serving: bool = True, engine: Engine | None = None
) -> RunningServer:
    """Listen at once (health NOT_SERVING), then load and warm the model and turn SERVING.

    `engine` serves in place of the DiffusionEngine built from `settings.engine` (tests pass doubles).

    Raises:
        SettingsError: a TLS file or the token file is unreadable or unusable, or --otlp-endpoint is given
            without the `otlp` extra.
    """
    credentials = (
        ReloadableServerCredentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        if settings.serves_tls
        else None
    )
    tokens = AccessTokens(settings.auth_token_file) if settings.auth_token_file is not None else None
    observers = ServerObservers(settings)
    engine = engine if engine is not None else DiffusionEngine(settings.engine, observers.engine_observer)
    observers.watch_engine(engine)
    server = grpc.aio.server(
        # Outermost first: calls the token check refuses are counted and logged too.
        interceptors=[CallWatchInterceptor(observers), *([TokenAuthInterceptor(tokens)] if tokens is not None else [])],
        options=[
            ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            *server_keepalive_options(),
        ],
    )
    add_diffusion_service(DiffusionServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{settings.host}:{settings.port}"
    # With TLS there is no plaintext port at all.
    if credentials is not None:
        port = server.add_secure_port(address, credentials.credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not listen on {settings.host}:{settings.port}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    observers.start()
    running = RunningServer(
        server=server, engine=engine, health=health_servicer, port=port, credentials=credentials, tokens=tokens,
        observers=observers, metrics_port=observers.metrics_port,
    )  # fmt: skip

    async def become_serving() -> None:
        await engine.start()
        observers.serving(engine.describe())
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
    loop.add_signal_handler(signal.SIGHUP, running.reload_credentials)
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
