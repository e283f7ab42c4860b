"""`--compile-cache DIR`: torch's own compile caches kept in a folder that outlives the process.

Inductor's FX graph cache, the AOTAutograd cache and the compiled C++/Triton kernels all
live under `torch._inductor.runtime.cache_dir_utils.cache_dir()`, which is whatever
`TORCHINDUCTOR_CACHE_DIR` says when it is asked (torch's temporary folder otherwise);
torch's own `temporary_cache_dir` points it elsewhere for a while.
While the warm-up compiles, that variable points at a subfolder of DIR named by a hash
of everything that shapes the graphs (CompileCacheKey): a server started with another
model, dtype, rank, slot layers, quantization, compile settings, torch version or device
starts a folder of its own and never reads a stale one. torch's caches key each entry by
the graph, its inputs and inductor's config besides, so within one folder a miss is the
worst a change can cause, never a wrong kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# torch's counters of cache lookups (torch._dynamo.utils.counters[group][name]), reported after the warm-up.
_CACHE_COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
)


@dataclass(frozen=True)
class CompileCacheKey:
    """Everything that decides which graphs a start compiles; its digest names the cache subfolder."""

    model: str  # a built-in name, or a local folder's absolute path, or a Hub id
    layers: int | None
    dtype: str
    device: str  # e.g. "cpu (x86_64, AVX512)", "cuda (NVIDIA H200, sm_90)"
    max_rank: int
    rank_buckets: tuple[int, ...]
    target_layers: tuple[str, ...]
    quantize: str
    compile_kind: str
    compile_backend: str
    compile_mode: str
    torch_version: str
    diffusers_version: str
    python_version: str

    def digest(self) -> str:
        """A short stable hash of every field: the subfolder's name."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def folder(self, root: Path) -> Path:
        """The subfolder of `root` this key's artefacts live in."""
        return Path(root) / self.digest()


def device_description(device: torch.device) -> str:
    """The device as compiled code depends on it: the GPU model and compute capability, or the CPU's ISA."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda ({torch.cuda.get_device_name(index)}, sm_{major}{minor})"
    return f"{device.type} ({platform.machine()}, {torch.backends.cpu.get_cpu_capability()})"


def runtime_cache_key(
    *,
    model: str,
    layers: int | None,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
    rank_buckets: tuple[int, ...],
    target_layers: tuple[str, ...],
    quantize: str,
    compile_kind: str,
    compile_backend: str,
    compile_mode: str,
) -> CompileCacheKey:
    """The key of a runtime about to compile: its settings plus the torch, diffusers and Python it runs on."""
    import diffusers

    local = Path(model)
    return CompileCacheKey(
        model=str(local.resolve()) if local.is_dir() else model,
        layers=layers,
        dtype=str(dtype).removeprefix("torch."),
        device=device_description(device),
        max_rank=max_rank,
        rank_buckets=tuple(rank_buckets),
        target_layers=tuple(target_layers),
        quantize=quantize,
        compile_kind=compile_kind,
        compile_backend=compile_backend,
        compile_mode=compile_mode,
        torch_version=torch.__version__,
        diffusers_version=diffusers.__version__,
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
    )


@contextlib.contextmanager
def compile_cache_scope(folder: Path | None) -> Iterator[None]:
    """torch's compile caches read and write `folder` inside (nothing changes when None); logs hits and misses.

    The variable is process-wide: the start-up of one runtime at a time (the warm-up, where
    dynamo compiles) is what this scope is for.
    """
    if folder is None:
        yield
        return
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    folder.mkdir(parents=True, exist_ok=True)
    before = {name: counters[group][name] for group, name in _CACHE_COUNTERS}
    try:
        # Sets the variable, clears torch's in-memory caches bound to the previous folder, and restores both after.
        with temporary_cache_dir(str(folder.resolve())):
            yield
    finally:
        lookups = {name: counters[group][name] - before[name] for group, name in _CACHE_COUNTERS}
        log.info(
            "compile cache %s: FX graphs %d hit, %d missed; AOTAutograd %d hit, %d missed",
            folder, *lookups.values(),
            extra={"compile_cache": str(folder), **lookups},
        )  # fmt: skip
