"""Builds and runs the grpc.aio server: servicer, health, reflection, TLS, tokens, signals, graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraswap.server.access import AccessTokens
from loraswap.server.config import Settings, SettingsError
from loraswap.server.engine.diffusion_engine import DiffusionEngine
from loraswap.server.engine.errors import StartupStopped
from loraswap.server.engine.interface import Engine
from loraswap.server.observability.observers import ServerObservers
from loraswap.server.transport.call_watch import CallWatchInterceptor
from loraswap.server.transport.server_credentials import ReloadableServerCredentials
from loraswap.server.transport.servicer import DiffusionServicer, add_diffusion_service
from loraswap.server.transport.token_auth import TokenAuthInterceptor
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.wire import server_keepalive_options

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
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

T = TypeVar("T")


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
        """Re-read the TLS files, the token file and the URL token file (on SIGHUP); whatever is unusable keeps its
        previous contents."""
        for name, reloadable in (("TLS certificate", self.credentials), ("token file", self.tokens)):
            if reloadable is None:
                continue
            try:
                reloadable.reload()
            except SettingsError as error:
                log.error("kept the previous %s: %s", name, error)
            else:
                log.info("reloaded the %s", name)
        try:
            if self.engine.reload_url_tokens():
                log.info("reloaded the URL token file")
        except (ValueError, OSError) as error:  # the message names a line number, never a token
            log.error("kept the previous URL token file: %s", error)

    @property
    def starting(self) -> bool:
        """The model is still loading, warming up or preloading."""
        return self.warming is not None and not self.warming.done()

    async def stop(self, grace: float, hurry: asyncio.Event | None = None) -> bool:
        """Health NOT_SERVING, refuse new work (UNAVAILABLE), let queued and running work finish
        within `grace` seconds, fail what is left with UNAVAILABLE, then stop.

        A start-up still under way is stopped at its next stopping point (a phase's end, a warm-up step) and
        given the same `grace` to reach it. `hurry`, once set, ends either wait at once. Returns whether the
        queued and running work finished.

        Raises:
            TimeoutError: the engine's worker was still busy (inside torch) when the time ran out; it ends at its
                next stopping point, and a process must not finalize its interpreter before then (serve).
        """
        hurry = hurry or asyncio.Event()
        starting = self.starting
        await self.health.enter_graceful_shutdown()
        self.engine.stop_accepting()
        try:
            drained = await _unless_hurried(self.engine.drain(grace), hurry)
        except TimeoutError:
            drained = False
        if not drained:
            why = "a second stop signal came" if hurry.is_set() else f"its {grace:g} s grace period ran out"
            self.engine.abort_all(f"the server is shutting down and {why}; retry on another replica")
        try:
            # A moment for the aborted streams' statuses to reach their clients.
            await self.server.stop(SHUTDOWN_FLUSH_S)
            if starting:  # its next stopping point may be a compile away: the grace bounds the wait, as for work
                await _unless_hurried(self.engine.stop(timeout=grace), hurry)
            else:  # aborted work stops at its next step
                await self.engine.stop(timeout=SHUTDOWN_FLUSH_S)
        finally:
            if self.observers is not None:
                await asyncio.to_thread(self.observers.close)
        return drained


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


async def serve(settings: Settings) -> bool:
    """Run until SIGTERM or SIGINT, then drain gracefully, or stop the start-up if it is still under way.

    A second signal ends the wait at once. Returns True when the engine's threads have ended; False when its
    worker was still busy inside torch, and the caller must end the process without finalizing the interpreter
    (scheduler.py says why; cli.py does so).
    """
    running = await start_server(settings, wait_until_serving=False)
    stop_requested = asyncio.Event()
    hurry = asyncio.Event()

    def on_stop_signal() -> None:
        if not stop_requested.is_set():
            stop_requested.set()
        elif not hurry.is_set():
            log.info("a second stop signal: not waiting any longer")
            hurry.set()

    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_stop_signal)
    loop.add_signal_handler(signal.SIGHUP, running.reload_credentials)
    try:
        print(f"loraswap: listening on port {running.port}, loading {settings.engine.model}", flush=True)
        stopping = asyncio.ensure_future(stop_requested.wait())
        await asyncio.wait([running.warming, stopping], return_when=asyncio.FIRST_COMPLETED)
        if running.warming.done() and running.warming.exception() is not None:
            await running.server.stop(0)
            raise running.warming.exception()
        if not stopping.done():
            print(f"loraswap: serving {settings.engine.model} on port {running.port}", flush=True)
            freeze_start_up_objects()
            await stopping
        return await _stop_and_report(running, settings.grace_seconds, hurry)
    finally:
        # The stop is under way or done: a late signal must not kill the process as it exits (asyncio would
        # restore the default action, death by SIGTERM).
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)


def freeze_start_up_objects() -> None:
    """Move what start-up made (the pipeline's modules and tensors, compiled graphs: over half a million objects on
    full-size SDXL) out of the garbage collector's generations, so that a full collection scans only what serving
    allocates: unfrozen, each one paused the process (adapter loads, the event loop, step streaming) for about
    0.3 s. For a process that keeps its one pipeline until it exits."""
    gc.collect()
    gc.freeze()


async def _stop_and_report(running: RunningServer, grace: float, hurry: asyncio.Event) -> bool:
    """Stop a serving or starting server, its last log line saying how; False when its worker is still busy."""
    starting = running.starting
    if starting:
        log.info("stopping during start-up: waiting up to %.0f s for it to reach a stopping point", grace)
    else:
        log.info("stopping: draining for up to %.0f s", grace)
    during = " during start-up" if starting else ""
    try:
        drained = await running.stop(grace, hurry)
    except TimeoutError as busy:
        log.warning("stopped%s without waiting for the engine: %s", during, busy)
        return False
    if starting:
        # The worker has ended, so the start-up's outcome is on its way to `warming`.
        await asyncio.wait([running.warming], timeout=SHUTDOWN_FLUSH_S)
        outcome = running.warming
        stopped = outcome.exception() if outcome.done() and not outcome.cancelled() else None
        phase = f" (phase {stopped.phase})" if isinstance(stopped, StartupStopped) else ""
        log.info("stopped during start-up%s", phase)
    elif drained:
        log.info("stopped: the queued and running generations finished")
    else:
        log.info("stopped: the generations left failed with UNAVAILABLE (SHUTTING_DOWN)")
    return True


async def _unless_hurried(work: Awaitable[T], hurry: asyncio.Event) -> T:
    """Await `work`; if `hurry` is set first, cancel it and raise TimeoutError, as if its time had run out."""
    task = asyncio.ensure_future(work)
    hurried = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait([task, hurried], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise TimeoutError("a second stop signal came before it ended")
    return task.result()
