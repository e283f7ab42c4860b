"""Real servers on ports the OS picks, sized for CI's two cores, and clients to them.

`serving(...)` is the one way a test starts an in-process server and `client_of(running)` the one way it talks
to it, so that what every test server shares (loopback, port 0, one torch thread, the stop) is said once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from loraswap.client import AsyncLoraswapClient
from loraswap.server.app import RunningServer, start_server
from loraswap.server.config import Settings
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.interface import Engine

# `make test` runs two test workers on CI's two cores: with one torch thread each they fill the cores without
# crowding them, where torch's default (a thread per core in every process) would run four threads on two.
TEST_TORCH_THREADS = 1
# The backend compiled test servers hand dynamo's graphs to. Whether a request recompiles is decided by
# dynamo's guards; eager runs each captured graph as it is, skipping AOTAutograd's second trace, which made
# warm-ups two to three times longer here and every compiled step twice as slow. The no-recompilation tests
# still catch what they were written for under eager: with pipeline/compile.py's oneDNN switch undone, a
# compiled tiny-sdxl recompiles 6 times over test_swaps.SDXL_SIZES. test_inductor.py compiles as served.
TEST_COMPILE_BACKEND = "eager"
# A test server's stop: its tests have finished their calls by then, so the grace only covers stragglers.
STOP_GRACE_S = 1.0
# A test client's deadline for each call unless it says otherwise: the tiny models answer within seconds, and a
# call that waits behind others on a crowded CI machine still ends well inside it.
CLIENT_TIMEOUT_S = 120.0

_SERVER_FIELDS = frozenset(field.name for field in dataclasses.fields(Settings)) - {"engine"}


def server_settings(model: str, adapter_dir: Path | None, **options) -> Settings:
    """A test server's settings: loopback, port 0, rank-16 slot, compiled (TEST_COMPILE_BACKEND), one torch thread.

    Each keyword that names a Settings field (tls_cert, auth_token_file, metrics_port, ...) sets the server's,
    every other one the engine's (EngineConfig), defaults above included.
    """
    server = {name: options.pop(name) for name in list(options) if name in _SERVER_FIELDS}
    options.setdefault("max_rank", 16)
    options.setdefault("compile", True)
    options.setdefault("compile_backend", TEST_COMPILE_BACKEND)
    return Settings(
        engine=EngineConfig(model=model, adapter_dir=adapter_dir, torch_threads=TEST_TORCH_THREADS, **options),
        host="127.0.0.1",
        port=0,
        **server,
    )


def scripted_settings(**server) -> Settings:
    """Settings for a server whose engine the test passes in (a ScriptedEngine): loopback, port 0, and
    `server`'s Settings fields (tokens, TLS, metrics); start_server builds no engine from them."""
    return Settings(engine=EngineConfig(model="scripted"), host="127.0.0.1", port=0, **server)


@contextlib.asynccontextmanager
async def serving(
    settings: Settings | str,
    adapter_dir: Path | None = None,
    *,
    engine: Engine | None = None,
    wait_until_serving: bool = True,
    **options,
) -> AsyncIterator[RunningServer]:
    """A real server (app.start_server) for the length of the block, stopped on the way out however it ends.

    `settings` is a Settings, or a model name that `server_settings(settings, adapter_dir, **options)` makes
    them for. `engine` serves in place of the one `settings` would build; with `wait_until_serving=False` the
    block starts while the model still loads (health NOT_SERVING).
    """
    if isinstance(settings, str):
        settings = server_settings(settings, adapter_dir, **options)
    elif adapter_dir is not None or options:
        raise TypeError("serving(Settings) takes no adapter_dir or settings keywords: put them in the Settings")
    running = await start_server(settings, wait_until_serving=wait_until_serving, engine=engine)
    try:
        yield running
    finally:
        await running.stop(STOP_GRACE_S)


def address_of(running: RunningServer) -> str:
    """Where a test server listens, as a gRPC target ("127.0.0.1:PORT")."""
    return f"127.0.0.1:{running.port}"


def client_of(
    running: RunningServer, *, default_timeout: float | None = CLIENT_TIMEOUT_S, **options
) -> AsyncLoraswapClient:
    """An AsyncLoraswapClient to a test server, to use as `async with client_of(running) as client`.

    `options` are the client's own (token, tls, wait_for_ready).
    """
    return AsyncLoraswapClient(address_of(running), default_timeout=default_timeout, **options)
