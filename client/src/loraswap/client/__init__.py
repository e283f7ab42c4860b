"""Client library for a loraswap server: an asyncio client, a blocking wrapper, typed results and errors.

>>> from loraswap.client import LoraswapClient
>>> with LoraswapClient("localhost:50051") as client:
...     image = client.generate_image("a lighthouse at dusk", adapter="watercolor", adapter_scale=0.8)
...     image.save("lighthouse.png")
"""

from loraswap.client.aio import USE_DEFAULT_TIMEOUT, AdapterStack, AsyncLoraswapClient, GenerateOptions, ImageFormat
from loraswap.client.connection import TlsConfig
from loraswap.client.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    InternalError,
    InvalidRequest,
    LoraswapError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
    error_reason_value,
)
from loraswap.client.events import (
    AdapterInfo,
    AdapterList,
    Event,
    GeneratedImage,
    PreloadResult,
    Progress,
    Queued,
    ServerInfo,
    StackedAdapter,
    Timings,
)
from loraswap.client.sync import LoraswapClient

__all__ = [
    "USE_DEFAULT_TIMEOUT",
    "AdapterInfo",
    "AdapterList",
    "AdapterStack",
    "AsyncLoraswapClient",
    "Cancelled",
    "DeadlineExceeded",
    "Event",
    "FailedPrecondition",
    "FieldViolation",
    "GenerateOptions",
    "GeneratedImage",
    "ImageFormat",
    "InternalError",
    "InvalidRequest",
    "LoraswapClient",
    "LoraswapError",
    "NotFound",
    "PermissionDenied",
    "PreloadResult",
    "Progress",
    "Queued",
    "ResourceExhausted",
    "ServerInfo",
    "StackedAdapter",
    "Timings",
    "TlsConfig",
    "Unauthenticated",
    "Unavailable",
    "error_from_rpc",
    "error_reason_value",
]
