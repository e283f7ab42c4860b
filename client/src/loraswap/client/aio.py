"""The asyncio client for a loraswap server."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal, TypeVar

import grpc

from loraswap.client.errors import InternalError, InvalidRequest, LoraswapError, error_from_rpc
from loraswap.client.events import (
    AdapterList,
    Event,
    GeneratedImage,
    PreloadResult,
    Progress,
    ServerInfo,
    event_from_pb,
)
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_TARGET",
    "USE_DEFAULT_TIMEOUT",
    "AsyncLoraswapClient",
    "ImageFormat",
    "Timeout",
    "build_generate_request",
    "missing_image_error",
]

DEFAULT_TARGET = "localhost:50051"

ImageFormat = Literal["png", "jpeg", "webp"]

_IMAGE_FORMAT_BY_NAME = {
    "png": pb.IMAGE_FORMAT_PNG,
    "jpeg": pb.IMAGE_FORMAT_JPEG,
    "jpg": pb.IMAGE_FORMAT_JPEG,
    "webp": pb.IMAGE_FORMAT_WEBP,
}

# gRPC refuses messages over 4 MiB by default; a lossless 2048x2048 image is
# larger than that, and the whole image travels in one message.
_MAX_RECEIVE_MESSAGE_BYTES = 256 * 1024 * 1024


class _DefaultTimeout(enum.Enum):
    TOKEN = enum.auto()


USE_DEFAULT_TIMEOUT = _DefaultTimeout.TOKEN
"""Per-call ``timeout`` marker: use the client's ``default_timeout``. (None means no deadline.)"""

Timeout = float | None | _DefaultTimeout

_Result = TypeVar("_Result")


def build_generate_request(
    prompt: str,
    *,
    adapter: str = "",
    adapter_scale: float | None = None,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    width: int | None = None,
    height: int | None = None,
    seed: int | None = None,
    negative_prompt: str = "",
    image_format: ImageFormat = "png",
) -> pb.GenerateRequest:
    """Builds a GenerateRequest; arguments left as None stay unset so the server applies its defaults.

    Raises:
        InvalidRequest: an argument cannot be encoded (unknown image format,
            negative seed, a number out of its field's range).
    """
    encoded_format = _IMAGE_FORMAT_BY_NAME.get(image_format.lower())
    if encoded_format is None:
        raise InvalidRequest(
            f"unknown image format {image_format!r}; use one of png, jpeg, webp",
        )
    optional_fields: dict[str, Any] = {
        "adapter_scale": adapter_scale,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "width": width,
        "height": height,
        "seed": seed,
    }
    try:
        return pb.GenerateRequest(
            prompt=prompt,
            negative_prompt=negative_prompt,
            adapter=adapter,
            image_format=encoded_format,
            **{name: value for name, value in optional_fields.items() if value is not None},
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"cannot encode the request: {exc}") from exc


class AsyncLoraswapClient:
    """An asyncio client for a loraswap ``DiffusionService``.

    Every call carries a deadline (``default_timeout`` seconds unless the
    call's ``timeout`` says otherwise; None means none) and raises only
    :class:`~loraswap.client.errors.LoraswapError` subclasses.

    Use it as ``async with AsyncLoraswapClient(...) as client:`` or call
    :meth:`close` when done. The channel is opened on first use, so the
    client may be constructed outside a running event loop.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        default_timeout: float | None = 300.0,
        channel: grpc.aio.Channel | None = None,
        wait_for_ready: bool = True,
    ) -> None:
        """Creates a client for the server at ``target`` ("host:port"), or on ``channel`` if given.

        A channel passed in stays the caller's: :meth:`close` leaves it open.
        With ``wait_for_ready`` calls wait (up to their deadline) for an
        unreachable server instead of failing at once with UNAVAILABLE.
        """
        self.target = target
        self.default_timeout = default_timeout
        self.wait_for_ready = wait_for_ready
        self._channel = channel
        self._owns_channel = channel is None
        self._stub: pb_grpc.DiffusionServiceStub | None = None

    async def __aenter__(self) -> AsyncLoraswapClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel this client opened; calls in flight are cancelled."""
        if self._owns_channel and self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    def _service(self) -> pb_grpc.DiffusionServiceStub:
        if self._stub is None:
            if self._channel is None:
                # Opened here rather than in __init__ because an aio channel
                # binds to the event loop that is running when it is made.
                self._channel = grpc.aio.insecure_channel(
                    self.target, options=[("grpc.max_receive_message_length", _MAX_RECEIVE_MESSAGE_BYTES)]
                )
            self._stub = pb_grpc.DiffusionServiceStub(self._channel)
        return self._stub

    def _deadline(self, timeout: Timeout) -> float | None:
        return self.default_timeout if timeout is USE_DEFAULT_TIMEOUT else timeout

    async def generate(
        self,
        prompt: str,
        *,
        adapter: str = "",
        adapter_scale: float | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        width: int | None = None,
        height: int | None = None,
        seed: int | None = None,
        negative_prompt: str = "",
        image_format: ImageFormat = "png",
        timeout: Timeout = USE_DEFAULT_TIMEOUT,
    ) -> AsyncGenerator[Event, None]:
        """Generates one image, yielding ``Queued`` and ``Progress`` events as they arrive, then the ``GeneratedImage``.

        Arguments left as None are not sent, so the server's defaults apply.
        Leaving the loop early (``break``) or cancelling the consuming task
        cancels the RPC, which stops the generation on the server; wrap the
        iterator in ``contextlib.aclosing`` to make that happen at the
        ``break`` rather than when the iterator is collected.

        Raises:
            LoraswapError: the call failed; the subclass says how.
        """
        request = build_generate_request(
            prompt,
            adapter=adapter,
            adapter_scale=adapter_scale,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            width=width,
            height=height,
            seed=seed,
            negative_prompt=negative_prompt,
            image_format=image_format,
        )
        deadline = _Deadline(self._deadline(timeout))
        while True:
            call = self._service().Generate(request, timeout=deadline.remaining(), wait_for_ready=self.wait_for_ready)
            received = False
            try:
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        return
                    received = True
                    event = event_from_pb(response)
                    if event is not None:
                        yield event
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if received or not await self._wait_while_starting(error, deadline):
                    raise error from exc
            finally:
                # A no-op when the stream finished; otherwise the consumer walked
                # away or was cancelled, and the server should stop working.
                call.cancel()

    async def generate_image(
        self,
        prompt: str,
        *,
        on_progress: Callable[[Progress], object] | None = None,
        adapter: str = "",
        adapter_scale: float | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        width: int | None = None,
        height: int | None = None,
        seed: int | None = None,
        negative_prompt: str = "",
        image_format: ImageFormat = "png",
        timeout: Timeout = USE_DEFAULT_TIMEOUT,
    ) -> GeneratedImage:
        """Generates one image and returns it, calling ``on_progress`` with each completed step.

        Takes the same arguments as :meth:`generate`.

        Raises:
            LoraswapError: the call failed, or the stream ended without an image.
        """
        events = self.generate(
            prompt,
            adapter=adapter,
            adapter_scale=adapter_scale,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            width=width,
            height=height,
            seed=seed,
            negative_prompt=negative_prompt,
            image_format=image_format,
            timeout=timeout,
        )
        image: GeneratedImage | None = None
        # Read to the end of the stream, not just to the image, so that the
        # call finishes with the server's status instead of being cancelled.
        async for event in events:
            if isinstance(event, GeneratedImage):
                image = event
            elif isinstance(event, Progress) and on_progress is not None:
                on_progress(event)
        if image is None:
            raise missing_image_error()
        return image

    async def preload_adapter(self, name: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> PreloadResult:
        """Makes the server fetch, validate and cache adapter ``name`` so its first use pays no load.

        Idempotent: ``already_cached`` tells whether anything was loaded.
        """
        response = await self._unary(self._service().PreloadAdapter, pb.PreloadAdapterRequest(adapter=name), timeout)
        return PreloadResult.from_pb(response)

    async def evict(self, name: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> int:
        """Drops adapter ``name`` from the server's caches and returns the bytes freed.

        Raises:
            NotFound: the adapter is not cached.
        """
        response = await self._unary(self._service().Evict, pb.EvictRequest(adapter=name), timeout)
        return response.freed_bytes

    async def list_adapters(self, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> AdapterList:
        """Lists the adapters in the server's cache, most recently used first."""
        response = await self._unary(self._service().ListAdapters, pb.ListAdaptersRequest(), timeout)
        return AdapterList.from_pb(response)

    async def server_info(self, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> ServerInfo:
        """Describes the server's resident model, its swap slot and its request defaults."""
        response = await self._unary(self._service().GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return ServerInfo.from_pb(response)

    async def _unary(
        self,
        method: Callable[..., Awaitable[_Result]],
        request: object,
        timeout: Timeout,
    ) -> _Result:
        deadline = _Deadline(self._deadline(timeout))
        while True:
            try:
                return await method(request, timeout=deadline.remaining(), wait_for_ready=self.wait_for_ready)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if not await self._wait_while_starting(error, deadline):
                    raise error from exc

    async def _wait_while_starting(self, error: LoraswapError, deadline: _Deadline) -> bool:
        """With wait_for_ready, a server still loading its model (UNAVAILABLE, NOT_SERVING) is waited for.

        gRPC's own wait_for_ready only waits for a connection; a loraswap server
        accepts connections while it warms up, so the client waits for SERVING here.
        Returns True when the call should be retried.
        """
        if not (
            self.wait_for_ready
            and error.code == grpc.StatusCode.UNAVAILABLE
            and error.reason_value == pb.ERROR_REASON_NOT_SERVING
        ):
            return False
        pause = deadline.next_pause()
        remaining = deadline.remaining()
        if remaining is not None and remaining <= pause:
            return False
        await asyncio.sleep(pause)
        return True


class _Deadline:
    """A call's overall deadline, shared by its retries, and the growing pause between them."""

    def __init__(self, timeout: float | None) -> None:
        self._ends_at = None if timeout is None else time.monotonic() + timeout
        self._pause_s = 0.1

    def next_pause(self) -> float:
        pause, self._pause_s = self._pause_s, min(self._pause_s * 1.5, 2.0)
        return pause

    def remaining(self) -> float | None:
        return None if self._ends_at is None else max(0.0, self._ends_at - time.monotonic())


def missing_image_error() -> LoraswapError:
    """The error for a Generate stream that ended without its final image (a server bug)."""
    return InternalError("the server ended the Generate stream without an image")
