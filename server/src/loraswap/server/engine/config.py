"""The engine's settings: one frozen object, filled by the front end from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraswap.server.engine.compile_options import normalize_compile

DEFAULT_MAX_RANK = 64
DEFAULT_MAX_STACK = 4
DEFAULT_ADAPTER_CACHE_BYTES = 8 * 1024**3
DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3
# The torch.compile backends `--compile-backend` offers (all in torch._dynamo.list_backends(exclude_tags=())):
# inductor for serving, cudagraphs for CUDA, eager and aot_eager to check compile paths quickly on CPU.
COMPILE_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
# --quantize: how the denoiser's base linear weights are stored (engine/pipeline/quantization.py does it with torchao).
QUANTIZATIONS = ("none", "int8wo", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """How to load, prepare and run the resident pipeline and its adapters."""

    model: str = "shapes"
    layers: int | None = None  # random-flux only: double-stream blocks kept (single-stream: twice that)
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    max_rank: int = DEFAULT_MAX_RANK
    # The ranks the slot computes at (ascending, up to max_rank); None: rank_buckets.default_rank_buckets(max_rank).
    rank_buckets: tuple[int, ...] | None = None
    max_stack: int = DEFAULT_MAX_STACK  # most adapters one request may stack
    target_modules: tuple[str, ...] | None = None  # None: the family's defaults
    # none, full or regional (compile_options.py; True/False, the old switch, mean full/none); None: full on cuda only
    compile: str | None = None
    compile_backend: str = "inductor"
    compile_mode: str = "default"  # torch.compile's mode (inductor); CUDA-graph modes run without graphs off CUDA
    compile_cache: Path | None = None  # compiled artefacts persist here between starts, in a keyed subfolder
    quantize: str = "none"  # none, int8wo or fp8: torchao storage of the denoiser's base linear weights
    # A diffusers attention backend (attention.py); None: the fastest installed on CUDA, native elsewhere.
    attention: str | None = None
    adapter_dir: Path | None = None
    allow_hub: bool = False
    # Bases accepted beside the served one, for adapters that declare theirs (adapters/base_model.py).
    allow_base: tuple[str, ...] = ()
    strict_adapters: bool = False
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    adapter_cache_bytes: int = DEFAULT_ADAPTER_CACHE_BYTES
    # CUDA: device memory for a hot set of recently swapped adapters (adapters/device_cache.py); 0: none.
    device_adapter_bytes: int = 0
    preload: tuple[str, ...] = ()  # adapters loaded before the server turns SERVING
    pin: tuple[str, ...] = ()  # adapters preloaded and kept out of LRU eviction (their bytes count in the budget)
    max_queue: int = 64
    max_bypass: int = 4  # times a waiting request may be passed over for one using the resident adapter
    max_size: int = 2048
    torch_threads: int | None = None  # None: the cores this process may use
    warmup: bool = True

    def __post_init__(self) -> None:
        # The old on/off switch (compile=True/False) names a kind; the kinds themselves are checked by the runtime.
        object.__setattr__(self, "compile", normalize_compile(self.compile))
