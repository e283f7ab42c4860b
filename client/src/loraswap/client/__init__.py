"""Client library for a loraswap server: an asyncio client, a blocking wrapper, typed results and errors.

>>> from loraswap.client import LoraswapClient
>>> with LoraswapClient("localhost:50051") as client:
...     image = client.generate_image("a lighthouse at dusk", adapter="watercolor", adapter_scale=0.8)
...     image.save("lighthouse.png")
"""

from loraswap.client.aio import USE_DEFAULT_TIMEOUT, AsyncLoraswapClient, ImageFormat
from loraswap.client.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidRequest,
    LoraswapError,
    NotFound,
    ResourceExhausted,
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
    Timings,
)
from loraswap.client.sync import LoraswapClient

__all__ = [
    "USE_DEFAULT_TIMEOUT",
    "AdapterInfo",
    "AdapterList",
    "AsyncLoraswapClient",
    "Cancelled",
    "DeadlineExceeded",
    "Event",
    "FailedPrecondition",
    "GeneratedImage",
    "ImageFormat",
    "InternalError",
    "InvalidRequest",
    "LoraswapClient",
    "LoraswapError",
    "NotFound",
    "PreloadResult",
    "Progress",
    "Queued",
    "ResourceExhausted",
    "ServerInfo",
    "Timings",
    "Unavailable",
    "error_from_rpc",
    "error_reason_value",
]
