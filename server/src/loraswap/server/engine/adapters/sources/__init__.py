"""Sources: where an adapter's bytes come from, and whether to trust them.

The adapter names' grammar, the adapter directory, the Hugging Face Hub, https URLs with their policy, their names,
their connection and their disk cache, the safetensors reader that opens every untrusted file, and the base-model
claims a file or its card makes.

May import: the engine's leaves (errors, types, observer, scale limits) and loraswap.adapter_urls. Knows nothing of
torch modules, of what a file's keys mean (formats/) or of the resident model (residency/). Other code uses the
names below, never a module inside.
"""

from __future__ import annotations

from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.adapter_names import (
    check_name,
    parse_hub_ref,
    split_names,
)
from loraswap.server.engine.adapters.sources.adapter_sources import AdapterSources
from loraswap.server.engine.adapters.sources.base_model import (
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX_DEV,
    FLUX_SCHNELL,
    MAX_CARD_BASES,
    MAX_DECLARATION_CHARS,
    QWEN_IMAGE,
    SDXL_BASE,
    SOURCE_BASE_MODEL,
    SOURCE_KOHYA,
    SOURCE_MODEL_CARD,
    SOURCE_MODELSPEC,
    Z_IMAGE_TURBO,
    BaseModel,
    BaseModelPolicy,
    normalise,
    read_declarations,
)
from loraswap.server.engine.adapters.sources.download_cache import (
    DownloadCache,
)
from loraswap.server.engine.adapters.sources.hub_source import HubAdapterSource
from loraswap.server.engine.adapters.sources.local_directory import LocalAdapterDirectory
from loraswap.server.engine.adapters.sources.safetensors_file import (
    LORA_ADAPTER_METADATA_KEY,
    read_adapter_file,
    read_safetensors_metadata,
)
from loraswap.server.engine.adapters.sources.url_fetch import (
    UrlAdapterSource,
    UrlTimeouts,
)
from loraswap.server.engine.adapters.sources.url_names import (
    is_url_name,
    loggable_name,
    parse_url_name,
    public_name,
)
from loraswap.server.engine.adapters.sources.url_policy import (
    UrlPolicy,
    UrlTokens,
    check_host_rule,
    host_matches,
    read_token_file,
)

__all__ = [
    "FLUX2_DEV",
    "FLUX2_KLEIN_4B",
    "FLUX_DEV",
    "FLUX_SCHNELL",
    "LORA_ADAPTER_METADATA_KEY",
    "MAX_CARD_BASES",
    "MAX_DECLARATION_CHARS",
    "QWEN_IMAGE",
    "SDXL_BASE",
    "SOURCE_BASE_MODEL",
    "SOURCE_KOHYA",
    "SOURCE_MODELSPEC",
    "SOURCE_MODEL_CARD",
    "Z_IMAGE_TURBO",
    "AdapterFile",
    "AdapterSources",
    "BaseModel",
    "BaseModelPolicy",
    "DownloadCache",
    "HubAdapterSource",
    "LocalAdapterDirectory",
    "UrlAdapterSource",
    "UrlPolicy",
    "UrlTimeouts",
    "UrlTokens",
    "check_host_rule",
    "check_name",
    "host_matches",
    "is_url_name",
    "loggable_name",
    "normalise",
    "parse_hub_ref",
    "parse_url_name",
    "public_name",
    "read_adapter_file",
    "read_declarations",
    "read_safetensors_metadata",
    "read_token_file",
    "split_names",
]
