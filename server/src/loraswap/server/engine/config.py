"""The engine's settings: one frozen object, filled by the front end from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_RANK = 64
DEFAULT_MAX_STACK = 4
DEFAULT_ADAPTER_CACHE_BYTES = 8 * 1024**3
DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class EngineConfig:
    """How to load, prepare and run the resident pipeline and its adapters."""

    model: str = "shapes"
    layers: int | None = None  # random-flux only: double-stream blocks kept (single-stream: twice that)
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    max_rank: int = DEFAULT_MAX_RANK
    max_stack: int = DEFAULT_MAX_STACK  # most adapters one request may stack
    target_modules: tuple[str, ...] | None = None  # None: the family's defaults
    compile: bool | None = None  # None: compile on cuda only
    compile_backend: str = "inductor"
    adapter_dir: Path | None = None
    allow_hub: bool = False
    strict_adapters: bool = False
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    adapter_cache_bytes: int = DEFAULT_ADAPTER_CACHE_BYTES
    max_queue: int = 64
    max_bypass: int = 4  # times a waiting request may be passed over for one using the resident adapter
    max_size: int = 2048
    torch_threads: int | None = None  # None: the cores this process may use
    warmup: bool = True
