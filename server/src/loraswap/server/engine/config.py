"""The engine's settings: one frozen object, each field declared once with everything a front end needs.

A field made by `setting(...)` (setting_spec.py) is a setting of `loraswap serve`: its name gives the flag
(`max_rank` -> `--max-rank`) and the environment twin (`LORASWAP_MAX_RANK`), its default is
the dataclass default, and its `SettingSpec` says how the text of a flag or variable becomes
the value, which values are allowed, and the help line. The front end (loraswap.server.config)
derives its argument parser and environment reading from these fields and nothing else.
The engine's rules that the values alone decide (compile options, quantization and fuse policy,
rank buckets, byte budgets) are checked here, once, when the config is made. What depends on
this process's devices and packages (fp8's CUDA capability, torchao, an attention backend) needs
torch and diffusers, so pipeline/preflight.py checks it before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraswap.server.engine.compile_options import (
    COMPILE_KINDS,
    COMPILE_MODES,
    compile_options_problem,
    normalize_compile,
)
from loraswap.server.engine.fuse_policy import FUSE_POLICIES
from loraswap.server.engine.models import BUILTINS
from loraswap.server.engine.quantize_options import FUSABLE_QUANTIZATIONS, QUANTIZATIONS, quantize_option_problem
from loraswap.server.engine.rank_buckets import parse_rank_buckets, resolve_rank_buckets
from loraswap.server.engine.setting_spec import (
    SettingsError,
    SettingSpec,
    check_setting,
    names,
    optional_names,
    optional_path,
    optional_text,
    positive_seconds,
    setting,
    setting_fields,
)

# How settings are declared lives in setting_spec.py; the server's own settings (loraswap.server.config) import
# those names from here, beside EngineConfig.
__all__ = [
    "COMPILE_BACKENDS",
    "DEFAULT_ADAPTER_CACHE_BYTES",
    "DEFAULT_MAX_ADAPTER_BYTES",
    "DEFAULT_MAX_RANK",
    "DEFAULT_MAX_STACK",
    "DTYPES",
    "TEXT_ENCODER_LAYER_POLICIES",
    "EngineConfig",
    "SettingSpec",
    "SettingsError",
    "adapter_names",
    "check_setting",
    "default_download_cache_dir",
    "optional_path",
    "optional_text",
    "setting",
    "setting_fields",
    "url_host",
]

DEFAULT_MAX_RANK = 64
DEFAULT_MAX_STACK = 4
DEFAULT_ADAPTER_CACHE_BYTES = 8 * 1024**3
DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3
# The torch.compile backends `--compile-backend` offers (all in torch._dynamo.list_backends(exclude_tags=())):
# inductor for serving, cudagraphs for CUDA, eager and aot_eager to check compile paths quickly on CPU.
COMPILE_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
DTYPES = ("float32", "float16", "bfloat16")
# --text-encoder-layers: merge adapters' text-encoder layers into the text encoders, or drop them.
TEXT_ENCODER_LAYER_POLICIES = ("apply", "ignore")


# -- the engine's own readers of flag text ---------------------------------------------------------------


def adapter_names(text: str) -> tuple[str, ...]:
    """`a, b,,https://h/x?a=1,2` -> ("a", "b", "https://h/x?a=1,2"): a URL's query keeps its commas."""
    from loraswap.server.engine.adapters.sources import split_names

    return split_names(text)


def url_host(text: str) -> str:
    """One --allow-url-host value: a host name, `*.domain` or IP address, lower case."""
    from loraswap.server.engine.adapters.sources import check_host_rule

    return check_host_rule(text)


def default_download_cache_dir() -> Path:
    """$XDG_CACHE_HOME/loraswap/adapters, else ~/.cache/loraswap/adapters."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loraswap" / "adapters"


@dataclass(frozen=True)
class EngineConfig:
    """How to load, prepare and run the resident pipeline and its adapters."""

    model: str = setting("shapes", f"built-in model ({', '.join(BUILTINS)}), a diffusers folder, or a Hub id")
    layers: int | None = setting(
        None,
        "the random-* models with depth: keep N blocks (random-flux: N double-stream, 2N single; random-flux2-klein: "
        "N double, 4N single; random-qwen-image, random-z-image: N blocks) (default: all)",
        parse=int,
    )
    device: str | None = setting(None, "torch device (default: cuda when available, else cpu)", parse=optional_text)
    dtype: str | None = setting(
        None, "the model's dtype (default: bfloat16 on cuda, float32 on cpu)", parse=optional_text, choices=DTYPES
    )
    adapter_dir: Path | None = setting(
        None,
        "directory of adapter files that requests may name (default: none; shapes: its shipped adapters)",
        parse=optional_path,
    )
    max_rank: int = setting(DEFAULT_MAX_RANK, "highest adapter rank the swap slot takes", parse=int)
    max_stack: int = setting(
        DEFAULT_MAX_STACK, "most adapters one request may stack (their ranks share --max-rank)", parse=int
    )
    # The ranks the slot computes at (ascending, up to max_rank); None: rank_buckets.default_rank_buckets(max_rank).
    rank_buckets: tuple[int, ...] | None = setting(
        None,
        "ascending ranks the slot computes at, each a graph compiled at warm-up: a request pays the smallest bucket "
        "holding its adapter's (a stack's summed) rank, the base model none (default: 16, 32, ... up to --max-rank; "
        "--max-rank is appended when missing)",
        parse=parse_rank_buckets,
        metavar="RANK,...",
    )
    target_modules: tuple[str, ...] | None = setting(
        None, "comma-separated layer-name suffixes the slot covers (default: the family's)", parse=optional_names
    )
    # none, full or regional (compile_options.py; True/False, the old switch, mean full/none); None: full on cuda only
    compile: str | None = setting(
        None,
        "torch.compile the whole denoiser (full; --compile alone), only its repeated blocks (regional: compiles "
        "faster) or nothing (none; also --no-compile; true/false in the variable mean full/none) (default: full on "
        "CUDA, regional for Z-Image, none on CPU)",
        parse=normalize_compile,
        choices=COMPILE_KINDS,
        const="full",
        negated=("none", "the same as --compile none"),
    )
    compile_backend: str = setting(
        "inductor", "torch.compile backend (eager, aot_eager: quick CPU runs)", choices=COMPILE_BACKENDS
    )
    compile_mode: str = setting(
        "default",
        "torch.compile mode, inductor only; off CUDA, reduce-overhead runs as default and max-autotune as "
        "max-autotune-no-cudagraphs (no CUDA graphs to capture)",
        choices=COMPILE_MODES,
    )
    compile_cache: Path | None = setting(
        None,
        "keep torch's compiled artefacts (inductor, AOTAutograd) in DIR between starts, in a subfolder keyed by "
        "model, dtype, rank, slot layers, quantization, compile settings, torch version and device (default: "
        "torch's own temporary folder)",
        parse=optional_path,
        metavar="DIR",
    )
    fuse: str = setting(
        "auto",
        "how a swap applies an adapter: never (copied into the swap slot; every step pays the LoRA branch), "
        "always (merged into the base weights from a pristine copy: a step costs the base model's) or auto "
        "(merged when a cost model of the layers' shapes and the adapters' ranks says the merge costs less than the "
        "LoRA branch over the request's steps: decided from the request alone, the same on every replica); adapters "
        "the slot cannot hold (DoRA, trained biases, ranks above --max-rank) are served fused unless never",
        choices=FUSE_POLICIES,
    )
    fuse_memory_bytes: int | None = setting(
        None,
        "most bytes the pristine copies of the base weights merges write may take, on the model's device: the slot "
        "layers' (--fuse auto|always), taken at start-up, and those of any other layer an adapter changes, taken "
        "at its first merge (default: on CUDA what the device has free after loading, less a tenth of its memory; on "
        "a CPU the host's available memory)",
        parse=int,
    )
    quantize: str = setting(
        "none",
        "torchao storage of the denoiser's base linear weights (LoRA factors never): int8 weight-only (CPU and "
        "CUDA; adapters are then served unfused only: --fuse auto never merges, --fuse always is refused) or fp8 "
        "(CUDA, compute capability 8.9+; fused merges requantize the weights from pristine copies, in place)",
        choices=QUANTIZATIONS,
    )
    # A diffusers attention backend (pipeline/attention.py); None: the fastest installed on CUDA, native elsewhere.
    attention: str | None = setting(
        None,
        "diffusers attention backend of the denoiser (diffusers' AttentionBackendName: native, flash, _flash_3, "
        "flex, sage, xformers, ...); off CUDA the native one runs (default: the fastest installed on CUDA, "
        "FlashAttention 3 on Hopper when installed, else native)",
        parse=optional_text,
        metavar="BACKEND",
    )
    allow_hub: bool = setting(False, "let adapter names fall back to Hugging Face Hub repo ids", switch=True)
    # Adapters from URLs (adapters/sources/url_policy.py, url_fetch.py, download_cache.py).
    allow_url_host: tuple[str, ...] = setting(
        (),
        "a host adapter names may be https:// URLs on (repeat the flag for more; *.example.com: its subdomains; "
        "the variable: comma-separated); none: no URL is fetched",
        parse=url_host,
        metavar="HOST",
        repeatable=True,
    )
    allow_insecure_url_host: tuple[str, ...] = setting(
        (),
        "a host adapter URLs may also reach over plain http:// (test servers only; repeatable)",
        parse=url_host,
        metavar="HOST",
        repeatable=True,
    )
    allow_url_private_addresses: bool = setting(
        False,
        "let URL host names resolve to loopback, private and link-local addresses (refused by default; an IP "
        "address named in --allow-url-host is always connected to as named)",
        switch=True,
    )
    url_token_file: Path | None = setting(
        None,
        "bearer tokens for URL hosts: lines `HOST TOKEN` or `HOST env:VARIABLE`; each goes to its own host only, "
        "never logged; re-read on SIGHUP",
        parse=optional_path,
        metavar="FILE",
    )
    url_ca_file: Path | None = setting(
        None,
        "PEM CA certificates that URL hosts' TLS certificates are verified against (default: the system's)",
        parse=optional_path,
        metavar="FILE",
    )
    adapter_cache_dir: Path | None = setting(
        None,
        "where downloaded URL adapters are kept, by the SHA-256 of their bytes, across restarts (default: "
        "$XDG_CACHE_HOME/loraswap/adapters or ~/.cache/loraswap/adapters)",
        parse=optional_path,
        metavar="DIR",
    )
    adapter_cache_dir_bytes: int = setting(
        0,
        "byte budget of --adapter-cache-dir: the least recently used files go to make room; 0: the disk's room",
        parse=int,
    )
    url_timeout_seconds: float = setting(
        30.0, "seconds a URL host may take to connect, and to send each piece of a download", parse=positive_seconds
    )
    url_deadline_seconds: float = setting(
        600.0, "seconds a URL adapter's whole download may take", parse=positive_seconds
    )
    # Bases accepted beside the served one, for adapters that declare theirs (adapters/sources/base_model.py).
    allow_base: tuple[str, ...] = setting(
        (),
        "comma-separated further base models (Hub ids, e.g. black-forest-labs/FLUX.1-schnell) whose adapters this "
        "server accepts, beside those made for the model it serves",
        parse=names,
    )
    text_encoder_layers: str = setting(
        "apply",
        "an adapter's text-encoder layers: apply (merged into the text encoders from pristine copies of the layers "
        "they change, counted against --fuse-memory-bytes) or ignore (dropped with a warning)",
        choices=TEXT_ENCODER_LAYER_POLICIES,
    )
    strict_adapters: bool = setting(
        False,
        "refuse adapters with layers the server would drop (text-encoder layers under --text-encoder-layers ignore) "
        "instead of dropping them",
        switch=True,
    )
    max_adapter_bytes: int = setting(DEFAULT_MAX_ADAPTER_BYTES, "largest adapter file accepted", parse=int)
    adapter_cache_bytes: int = setting(
        DEFAULT_ADAPTER_CACHE_BYTES, "host-memory budget of the adapter cache (pinned adapters count)", parse=int
    )
    # CUDA: device memory for a hot set of recently swapped adapters (adapters/residency/device_cache.py); 0: none.
    device_adapter_bytes: int = setting(
        0,
        "CUDA: device memory for the most recently swapped adapters, so that a swap between them is a copy within "
        "the device; 0: none (off CUDA: always none)",
        parse=int,
    )
    preload: tuple[str, ...] = setting(
        (),
        "comma-separated adapters to load before the server turns SERVING; start-up fails on one it cannot load",
        parse=adapter_names,
        metavar="NAME,...",
    )
    pin: tuple[str, ...] = setting(
        (),
        "comma-separated adapters to preload and keep out of LRU eviction (Evict refuses them)",
        parse=adapter_names,
        metavar="NAME,...",
    )
    max_queue: int = setting(64, "most requests that may wait", parse=int)
    max_bypass: int = setting(4, "times a request may be passed over for one needing no swap (0: FIFO)", parse=int)
    max_size: int = setting(2048, "largest width or height accepted", parse=int)
    torch_threads: int | None = setting(
        None,
        "torch CPU threads, fixed (default: the cores this process may use at start-up); 0: follow the cores other "
        "processes leave free (faster beside busy processes, but a request's image may then differ in its last bits "
        "with the machine's load)",
        parse=int,
    )
    warmup: bool = True  # not a setting: tests and benchmarks that only need the pipeline skip the warm-up

    def __post_init__(self) -> None:
        """Normalise the compile kind, then refuse values the engine cannot run, in one line (SettingsError).

        Only what the values decide: whether this process can serve them (fp8's device, torchao, the --attention
        backend) needs torch and diffusers, and pipeline/preflight.py asks it before anything is loaded.
        """
        # The old on/off switch (compile=True/False) names a kind.
        object.__setattr__(self, "compile", normalize_compile(self.compile))
        problem = compile_options_problem(self.compile, self.compile_mode, self.compile_backend)
        if problem is not None:
            raise SettingsError(problem)
        problem = quantize_option_problem(self.quantize)
        if problem is not None:
            raise SettingsError(problem)
        if self.fuse not in FUSE_POLICIES:
            raise SettingsError(f"--fuse {self.fuse!r} is not one of {', '.join(FUSE_POLICIES)}")
        if self.text_encoder_layers not in TEXT_ENCODER_LAYER_POLICIES:
            raise SettingsError(
                f"--text-encoder-layers {self.text_encoder_layers!r} is not one of "
                f"{', '.join(TEXT_ENCODER_LAYER_POLICIES)}"
            )
        if self.fuse == "always" and self.quantize not in FUSABLE_QUANTIZATIONS:
            raise SettingsError(
                f"--fuse always merges adapters into the base weights, and --quantize {self.quantize} weights are "
                f"served unfused only; use --fuse auto (it serves them unfused), or --quantize "
                f"{' or '.join(FUSABLE_QUANTIZATIONS)}"
            )
        if self.fuse_memory_bytes is not None and self.fuse_memory_bytes < 0:
            raise SettingsError(
                f"--fuse-memory-bytes {self.fuse_memory_bytes} is negative; give a byte budget, or --fuse never"
            )
        if self.torch_threads is not None and self.torch_threads < 0:
            raise SettingsError(
                f"--torch-threads {self.torch_threads} is negative; give a thread count, or 0 to follow the free cores"
            )
        if self.device_adapter_bytes < 0:
            raise SettingsError(
                f"--device-adapter-bytes {self.device_adapter_bytes} is negative; give a byte budget, or 0 "
                "for no adapters kept on the device"
            )
        check_setting(resolve_rank_buckets, self.rank_buckets, self.max_rank)
        if self.adapter_cache_dir_bytes < 0:
            raise SettingsError(
                f"--adapter-cache-dir-bytes {self.adapter_cache_dir_bytes} is negative; give a byte budget, or 0 for "
                "the disk's room"
            )
        if self.url_token_file is not None:
            from loraswap.server.engine.adapters.sources import read_token_file

            try:
                read_token_file(self.url_token_file)
            except (OSError, ValueError) as error:
                raise SettingsError(f"--url-token-file: {error}") from None

    @property
    def download_cache_dir(self) -> Path:
        """--adapter-cache-dir, or its default."""
        return self.adapter_cache_dir or default_download_cache_dir()

    @property
    def fuses(self) -> bool:
        """Whether swaps may merge adapters into the base weights: a policy other than never, and weights as loaded
        or fp8 (requantized in place from pristine copies). int8 weight-only weights are served unfused only: auto
        never fuses them, always refuses them."""
        return self.fuse != "never" and self.quantize in FUSABLE_QUANTIZATIONS
