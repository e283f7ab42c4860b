"""The asyncio client for a loraswap server."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

import grpc

from loraswap.adapter_urls import url_identity
from loraswap.client.connection import TlsConfig, open_channel
from loraswap.client.errors import InternalError, InvalidRequest, LoraswapError, error_from_rpc
from loraswap.client.events import (
    AdapterList,
    Event,
    GeneratedImage,
    GenerateStreamDecoder,
    PreloadResult,
    Progress,
    ServerInfo,
    StackedAdapter,
)
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc
from loraswap.wire import LORA_METADATA_KEY

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11+; annotations only, so 3.10 runs without it

__all__ = [
    "DEFAULT_TARGET",
    "USE_DEFAULT_TIMEOUT",
    "AdapterStack",
    "AsyncLoraswapClient",
    "GenerateOptions",
    "ImageCollector",
    "ImageFormat",
    "Timeout",
    "build_generate_request",
    "missing_image_error",
]

DEFAULT_TARGET = "localhost:50051"

ImageFormat = Literal["png", "jpeg", "webp"]
FuseChoice = Literal["fused", "unfused"]

_IMAGE_FORMAT_BY_NAME = {
    "png": pb.IMAGE_FORMAT_PNG,
    "jpeg": pb.IMAGE_FORMAT_JPEG,
    "jpg": pb.IMAGE_FORMAT_JPEG,
    "webp": pb.IMAGE_FORMAT_WEBP,
}
_FUSE_CHOICE_BY_NAME = {"fused": pb.FUSE_CHOICE_FUSED, "unfused": pb.FUSE_CHOICE_UNFUSED}


class _DefaultTimeout(enum.Enum):
    TOKEN = enum.auto()


USE_DEFAULT_TIMEOUT = _DefaultTimeout.TOKEN
"""Per-call ``timeout`` marker: use the client's ``default_timeout``. (None means no deadline.)"""

Timeout = float | None | _DefaultTimeout

AdapterStack = Sequence[str | tuple[str, float | None] | StackedAdapter]
"""Adapters to apply together: names (strength 1.0), ``(name, strength)`` pairs, or :class:`StackedAdapter`."""

_Result = TypeVar("_Result")


class GenerateOptions(TypedDict, total=False):
    """The keywords of one generation, taken alike by ``generate``, ``generate_image`` (both clients) and
    :func:`build_generate_request`. Each may be left out; those left out (or None) are not sent, so the
    server's defaults apply.

    - ``adapter`` (str): one LoRA adapter to apply; "" or left out: the base model.
    - ``adapter_scale`` (float): the strength of ``adapter`` (server default 1.0).
    - ``adapters`` (:data:`AdapterStack`): several adapters stacked, each at its own strength, e.g.
      ``[("ink", 0.8), ("paper", 0.5)]``; the server refuses it together with ``adapter`` or ``adapter_scale``.
    - ``num_inference_steps`` (int), ``guidance_scale`` (float), ``width`` and ``height`` (int, pixels).
    - ``seed`` (int): the noise seed; left out, the server picks one (the image says which).
    - ``negative_prompt`` (str): what the image should not show (models with classifier-free guidance).
    - ``image_format`` ("png", "jpeg" or "webp"; default "png").
    - ``preview_every`` (int): N > 0 puts a small preview picture in the ``Progress`` event of every N-th step
      and of the last (0: none).
    - ``fuse`` ("fused" or "unfused"): pins how the adapters are applied (merged into the base weights, or in the
      swap slot); left out, the server's ``--fuse`` policy decides. ``GeneratedImage.fused`` says which ran.
    """

    adapter: str
    adapter_scale: float | None
    num_inference_steps: int | None
    guidance_scale: float | None
    width: int | None
    height: int | None
    seed: int | None
    negative_prompt: str
    image_format: ImageFormat
    adapters: AdapterStack
    preview_every: int
    fuse: FuseChoice | None


GENERATE_KEYWORDS = GenerateOptions.__optional_keys__ | GenerateOptions.__required_keys__

_Function = TypeVar("_Function", bound=Callable)


def takes_generate_options(function: _Function) -> _Function:
    """Lists the GenerateOptions keywords, with their types, at the end of `function`'s docstring, so that
    ``help()`` shows every keyword that ``**options`` stands for (editors read ``Unpack[GenerateOptions]``)."""
    # Annotations stay text (from __future__ import annotations); TypedDict keeps them as ForwardRefs.
    keywords = ", ".join(
        f"{name}: {getattr(kind, '__forward_arg__', kind)}" for name, kind in GenerateOptions.__annotations__.items()
    )
    function.__doc__ = f"{function.__doc__ or ''}\n\n        Keywords (GenerateOptions): {keywords}.\n"
    return function


@takes_generate_options
def build_generate_request(prompt: str, **options: Unpack[GenerateOptions]) -> pb.GenerateRequest:
    """Builds a GenerateRequest from the :class:`GenerateOptions` keywords; those left out or None stay unset so
    the server applies its defaults.

    Raises:
        TypeError: a keyword that is not one of GenerateOptions.
        InvalidRequest: an argument cannot be encoded (unknown image format,
            negative seed, a number out of its field's range, an adapters
            entry that is not a name, a (name, strength) pair or a StackedAdapter).
    """
    unknown = sorted(set(options) - GENERATE_KEYWORDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the generate keywords are GenerateOptions'")
    image_format = options.pop("image_format", None) or "png"
    encoded_format = _IMAGE_FORMAT_BY_NAME.get(image_format.lower()) if isinstance(image_format, str) else None
    if encoded_format is None:
        raise InvalidRequest(
            f"unknown image format {image_format!r}; use one of png, jpeg, webp",
        )
    fuse = options.pop("fuse", None)
    encoded_fuse = _FUSE_CHOICE_BY_NAME.get(fuse.lower()) if isinstance(fuse, str) else None
    if fuse is not None and encoded_fuse is None:
        raise InvalidRequest(
            f"unknown fuse choice {fuse!r}; use fused or unfused, or leave it out for the server's policy"
        )
    adapters = options.pop("adapters", None) or ()
    if isinstance(adapters, str):
        raise InvalidRequest(f"adapters must be a list of adapters, not the string {adapters!r}")
    try:
        return pb.GenerateRequest(
            prompt=prompt,
            adapters=[_stacked_adapter_pb(entry) for entry in adapters],
            image_format=encoded_format,
            fuse=encoded_fuse or pb.FUSE_CHOICE_UNSPECIFIED,
            **{name: value for name, value in options.items() if value is not None},
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"cannot encode the request: {exc}") from exc


def _stacked_adapter_pb(entry: str | tuple[str, float | None] | StackedAdapter) -> pb.StackedAdapter:
    if isinstance(entry, StackedAdapter):
        name, scale = entry.adapter, entry.scale
    elif isinstance(entry, str):
        name, scale = entry, None
    else:
        name, scale = entry
    if scale is None:
        return pb.StackedAdapter(adapter=name)
    return pb.StackedAdapter(adapter=name, scale=scale)


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
        token: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        """Creates a client for the server at ``target`` ("host:port"), or on ``channel`` if given.

        A channel passed in stays the caller's: :meth:`close` leaves it open,
        and ``tls`` does not apply to it. With ``wait_for_ready`` calls wait
        (up to their deadline) for an unreachable server instead of failing
        at once with UNAVAILABLE. ``token`` is sent with every call as
        ``authorization: Bearer <token>`` (servers started with
        --auth-token-file need one); ``tls`` connects with TLS (None:
        plaintext), e.g. ``TlsConfig.from_files(ca_bundle="ca.pem")``.

        Raises:
            ValueError: the token has characters call metadata cannot carry.
        """
        self.target = target
        self.default_timeout = default_timeout
        self.wait_for_ready = wait_for_ready
        self.tls = tls
        self._call_metadata = _bearer_metadata(token)
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
                self._channel = open_channel(self.target, self.tls)
            self._stub = pb_grpc.DiffusionServiceStub(self._channel)
        return self._stub

    def _deadline(self, timeout: Timeout) -> float | None:
        return self.default_timeout if timeout is USE_DEFAULT_TIMEOUT else timeout

    @takes_generate_options
    async def generate(
        self, prompt: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerator[Event, None]:
        """Generates one image, yielding ``Queued`` and ``Progress`` events as they arrive, then the ``GeneratedImage``.

        ``options`` are the :class:`GenerateOptions` keywords (adapter, adapter_scale, adapters,
        num_inference_steps, guidance_scale, width, height, seed, negative_prompt, image_format,
        preview_every, fuse); those left out are not sent, so the server's defaults apply.
        Leaving the loop early (``break``) or cancelling the consuming task
        cancels the RPC, which stops the generation on the server; wrap the
        iterator in ``contextlib.aclosing`` to make that happen at the
        ``break`` rather than when the iterator is collected.

        Raises:
            LoraswapError: the call failed; the subclass says how.
        """
        request = build_generate_request(prompt, **options)
        deadline = _Deadline(self._deadline(timeout))
        while True:
            call = self._service().Generate(
                request,
                timeout=deadline.remaining(),
                wait_for_ready=self.wait_for_ready,
                metadata=self._metadata(*_adapter_names(request)),
            )
            decoder = GenerateStreamDecoder()
            received = False
            try:
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        return
                    received = True
                    event = decoder.decode(response)
                    if event is not None:
                        yield event
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if received or not await self._wait_while_starting(error, deadline):
                    raise error from exc
            finally:
                # A no-op when the stream finished; otherwise the consumer walked
                # away or was cancelled, and the server should stop working.
                call.cancel()

    @takes_generate_options
    async def generate_image(
        self,
        prompt: str,
        *,
        on_progress: Callable[[Progress], object] | None = None,
        timeout: Timeout = USE_DEFAULT_TIMEOUT,
        **options: Unpack[GenerateOptions],
    ) -> GeneratedImage:
        """Generates one image and returns it, calling ``on_progress`` with each completed step.

        Takes the same :class:`GenerateOptions` keywords as :meth:`generate`.

        Raises:
            LoraswapError: the call failed, or the stream ended without an image.
        """
        collector = ImageCollector(on_progress)
        # Read to the end of the stream, not just to the image, so that the
        # call finishes with the server's status instead of being cancelled.
        async for event in self.generate(prompt, timeout=timeout, **options):
            collector.add(event)
        return collector.image()

    async def preload_adapter(self, name: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> PreloadResult:
        """Makes the server fetch, validate and cache adapter ``name`` so its first use pays no load.

        Idempotent: ``already_cached`` tells whether anything was loaded.
        """
        response = await self._unary(
            self._service().PreloadAdapter, pb.PreloadAdapterRequest(adapter=name), timeout, lora=name
        )
        return PreloadResult.from_pb(response)

    async def evict(self, name: str, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> int:
        """Drops adapter ``name`` from the server's caches and returns the bytes freed.

        Raises:
            NotFound: the adapter is not cached.
        """
        response = await self._unary(self._service().Evict, pb.EvictRequest(adapter=name), timeout, lora=name)
        return response.freed_bytes

    async def list_adapters(self, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> AdapterList:
        """Lists the adapters in the server's cache, most recently used first: every page of ListAdapters (one
        page unless the listing passes 4 MiB), each page a call with its own `timeout`. Any use, load or
        eviction while pages are read shifts them: an adapter seen twice is listed once, where it came first,
        and one may be missed. Pages must come from one server process: through a front, list each replica."""
        pages = [await self._unary(self._service().ListAdapters, pb.ListAdaptersRequest(), timeout)]
        while pages[-1].next_page_token:
            request = pb.ListAdaptersRequest(page_token=pages[-1].next_page_token)
            pages.append(await self._unary(self._service().ListAdapters, request, timeout))
        return AdapterList.from_pages(pages)

    async def server_info(self, *, timeout: Timeout = USE_DEFAULT_TIMEOUT) -> ServerInfo:
        """Describes the server's resident model, its swap slot and its request defaults."""
        response = await self._unary(self._service().GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return ServerInfo.from_pb(response)

    async def _unary(
        self,
        method: Callable[..., Awaitable[_Result]],
        request: object,
        timeout: Timeout,
        *,
        lora: str = "",
    ) -> _Result:
        deadline = _Deadline(self._deadline(timeout))
        while True:
            try:
                return await method(
                    request,
                    timeout=deadline.remaining(),
                    wait_for_ready=self.wait_for_ready,
                    metadata=self._metadata(lora),
                )
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if not await self._wait_while_starting(error, deadline):
                    raise error from exc

    def _metadata(self, *adapters: str) -> tuple[tuple[str, str], ...] | None:
        """The call's metadata: the bearer token, and the `lora` key naming its adapters (a stack: comma-separated),
        so that a proxy can route on the adapter without parsing protobuf (the server checks both agree). None when a
        name is empty (no adapter, or a stack entry naming none: the server refuses that by the request's fields)."""
        lora = _lora_metadata(list(adapters)) if all(adapters) else ()
        return (*(self._call_metadata or ()), *lora) or None

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


_MAX_LORA_METADATA_CHARS = 4096


def _adapter_names(request: pb.GenerateRequest) -> tuple[str, ...]:
    """The adapters a GenerateRequest names, for its `lora` metadata; none when it sets both `adapter` and
    `adapters` (the server refuses that request for what it is, not for a metadata mismatch)."""
    members = tuple(member.adapter for member in request.adapters)
    if request.adapter and members:
        return ()
    return (request.adapter,) if request.adapter else members


def _lora_metadata(names: list[str]) -> tuple[tuple[str, str], ...]:
    """("lora", "a,b") for these adapter names; nothing when a name could not travel as a header value (the
    request's own fields still name the adapters, and the server refuses names outside its grammar). A URL goes
    as its identity (loraswap.adapter_urls.url_identity): its query, a presigned signature or a token, stays out of the
    headers that proxies route on and log, and every link to one object routes alike."""
    try:
        names = [url_identity(name) if "://" in name else name for name in names]
    except ValueError:
        return ()
    value = ",".join(names)
    if not value or len(value) > _MAX_LORA_METADATA_CHARS or any("," in name for name in names):
        return ()
    if not all("\x20" <= character <= "\x7e" for character in value):
        return ()
    return ((LORA_METADATA_KEY, value),)


def _bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    if not token:
        return None
    if not all("\x21" <= character <= "\x7e" for character in token):
        raise ValueError("a token must be visible ASCII characters only (no spaces); check the token")
    return (("authorization", f"Bearer {token}"),)


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


class ImageCollector:
    """What ``generate_image`` keeps of a stream's events, in either client: the image, each step passed on."""

    def __init__(self, on_progress: Callable[[Progress], object] | None = None) -> None:
        self._on_progress = on_progress
        self._image: GeneratedImage | None = None

    def add(self, event: Event) -> None:
        """Takes one event of the stream."""
        if isinstance(event, GeneratedImage):
            self._image = event
        elif isinstance(event, Progress) and self._on_progress is not None:
            self._on_progress(event)

    def image(self) -> GeneratedImage:
        """The stream's image; raises missing_image_error() when the stream ended without one."""
        if self._image is None:
            raise missing_image_error()
        return self._image


def missing_image_error() -> LoraswapError:
    """The error for a Generate stream that ended without its final image (a server bug)."""
    return InternalError("the server ended the Generate stream without an image")
