"""A blocking client for a loraswap server: the asyncio client run on a private event loop.

It also runs over a blocking ``grpc.Channel`` the caller made (custom credentials, interceptors,
options): the async client then sees that channel through a thin bridge with the grpc.aio call shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from loraswap.client.aio import (
    DEFAULT_TARGET,
    USE_DEFAULT_TIMEOUT,
    AsyncLoraswapClient,
    GenerateOptions,
    ImageCollector,
    Timeout,
    takes_generate_options,
)
from loraswap.client.connection import TlsConfig
from loraswap.client.events import AdapterList, Event, GeneratedImage, PreloadResult, Progress, ServerInfo

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11+; annotations only, so 3.10 runs without it

__all__ = ["LoraswapClient"]

_Result = TypeVar("_Result")


class LoraswapClient:
    """A blocking client for a loraswap ``DiffusionService``, with the same methods as the async one.

    The calls run on an event loop in a background thread that this client
    owns, so it may be used from any thread, including one that already runs
    an event loop of its own. Use it as ``with LoraswapClient(...) as client:``
    or call :meth:`close` when done.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        default_timeout: float | None = 300.0,
        wait_for_ready: bool = True,
        token: str | None = None,
        tls: TlsConfig | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        """Creates a client for the server at ``target`` ("host:port"); see ``AsyncLoraswapClient``.

        ``channel``: a blocking ``grpc.Channel`` to call over instead of one
        this client opens (``tls`` then does not apply); it stays the
        caller's, and :meth:`close` leaves it open.
        """
        self._async_client = AsyncLoraswapClient(
            target,
            default_timeout=default_timeout,
            wait_for_ready=wait_for_ready,
            token=token,
            tls=tls,
            channel=_BlockingChannelBridge(channel) if channel is not None else None,
        )
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name=f"loraswap-client-{target}", daemon=True
        )
        self._loop_thread.start()
        self._closed = False

    @property
    def target(self) -> str:
        """The server address, "host:port"."""
        return self._async_client.target

    def __enter__(self) -> LoraswapClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel and stops the background loop; calls in flight are cancelled."""
        if self._closed:
            return
        self._closed = True

        async def shut_down() -> None:
            await self._async_client.close()
            await self._loop.shutdown_asyncgens()
            # Settle what cancelled calls left behind (gRPC's own status
            # tasks among them) before the loop closes, as asyncio.run does.
            leftover_tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in leftover_tasks:
                task.cancel()
            await asyncio.gather(*leftover_tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shut_down(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()
            self._loop.close()

    def _run(self, coroutine: Coroutine[Any, Any, _Result]) -> _Result:
        if self._closed:
            coroutine.close()
            raise RuntimeError("this LoraswapClient is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            # On KeyboardInterrupt the call is still running on the loop; stop it.
            future.cancel()
            raise

    @takes_generate_options
    def generate(
        self, prompt: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT, **options: Unpack[GenerateOptions]
    ) -> Iterator[Event]:
        """Generates one image, yielding ``Queued`` and ``Progress`` events as they arrive, then the ``GeneratedImage``.

        ``options`` are the :class:`~loraswap.client.aio.GenerateOptions` keywords (adapter, adapter_scale,
        adapters, num_inference_steps, guidance_scale, width, height, seed, negative_prompt, image_format,
        preview_every, fuse); those left out are not sent, so the server's defaults apply.
        Leaving the loop early (``break``, an exception, Ctrl-C) cancels the RPC.

        Raises:
            LoraswapError: the call failed; the subclass says how.
        """
        if self._closed:
            raise RuntimeError("this LoraswapClient is closed")
        # None follows the stream's last event, whatever the stream's outcome.
        events: queue.SimpleQueue[Event | None] = queue.SimpleQueue()

        async def forward_events() -> None:
            stream = self._async_client.generate(prompt, timeout=timeout, **options)
            async with contextlib.aclosing(stream):
                async for event in stream:
                    events.put(event)

        forwarding = asyncio.run_coroutine_threadsafe(forward_events(), self._loop)
        forwarding.add_done_callback(lambda _: events.put(None))
        try:
            while (item := events.get()) is not None:
                yield item
            # Raises the stream's error, if it ended with one.
            forwarding.result()
        finally:
            # A no-op when the stream ended; otherwise the caller stopped
            # early and the RPC on the loop must stop too.
            forwarding.cancel()

    @takes_generate_options
    def generate_image(
        self,
        prompt: str,
        *,
        on_progress: Callable[[Progress], object] | None = None,
        timeout: Timeout = USE_DEFAULT_TIMEOUT,
        **options: Unpack[GenerateOptions],
    ) -> GeneratedImage:
        """Generates one image and returns it, calling ``on_progress`` (in this thread) with each completed step.

        Takes the same :class:`~loraswap.client.aio.GenerateOptions` keywords as :meth:`generate`.

        Raises:
            LoraswapError: the call failed, or the stream ended without an image.
        """
        collector = ImageCollector(on_progress)
        for event in self.generate(prompt, timeout=timeout, **options):
            collector.add(event)
        return collector.image()

    def preload_adapter(self, name: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> PreloadResult:
        """Makes the server fetch, validate and cache adapter ``name``; idempotent."""
        return self._run(self._async_client.preload_adapter(name, timeout=timeout))

    def evict(self, name: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> int:
        """Drops adapter ``name`` from the server's caches and returns the bytes freed."""
        return self._run(self._async_client.evict(name, timeout=timeout))

    def list_adapters(self, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> AdapterList:
        """Lists the adapters in the server's cache, most recently used first."""
        return self._run(self._async_client.list_adapters(timeout=timeout))

    def server_info(self, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> ServerInfo:
        """Describes the server's resident model, its swap slot and its request defaults."""
        return self._run(self._async_client.server_info(timeout=timeout))


class _BlockingChannelBridge:
    """A blocking ``grpc.Channel`` with the grpc.aio call shapes the async client uses.

    Unary calls become awaitables and streams gain an awaitable ``read()``; each
    blocking wait runs on a worker thread of the client's loop, and cancelling
    the awaiting task cancels the RPC.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel

    def unary_unary(self, method: str, **options: Any) -> Callable[..., Coroutine[Any, Any, Any]]:
        blocking_call = self._channel.unary_unary(method, **options)

        async def call(request: Any, **call_options: Any) -> Any:
            future = blocking_call.future(request, **call_options)
            try:
                return await asyncio.to_thread(future.result)
            except asyncio.CancelledError:
                future.cancel()
                raise

        return call

    def unary_stream(self, method: str, **options: Any) -> Callable[..., _BlockingStream]:
        blocking_call = self._channel.unary_stream(method, **options)
        return lambda request, **call_options: _BlockingStream(blocking_call(request, **call_options))


class _BlockingStream:
    """A blocking server stream read like a grpc.aio one: ``await read()`` until ``grpc.aio.EOF``."""

    def __init__(self, responses: Any) -> None:
        self._responses = responses  # iterator of messages and grpc.Call in one

    async def read(self) -> Any:
        """The next message, or grpc.aio.EOF after the last; raises the call's grpc.RpcError when it fails."""
        return await asyncio.to_thread(next, self._responses, grpc.aio.EOF)

    def cancel(self) -> bool:
        """Cancels the RPC (a waiting ``read`` then raises); False when it had already finished."""
        return self._responses.cancel()
