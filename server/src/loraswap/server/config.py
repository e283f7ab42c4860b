"""`loraswap serve` settings: one frozen object built from flags, each with a LORASWAP_* environment twin."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from loraswap.server.engine.compile_options import (
    COMPILE_KINDS,
    COMPILE_MODES,
    compile_options_problem,
    normalize_compile,
)
from loraswap.server.engine.config import COMPILE_BACKENDS, QUANTIZATIONS, EngineConfig
from loraswap.server.engine.models import BUILTINS
from loraswap.server.engine.rank_buckets import parse_rank_buckets, resolve_rank_buckets
from loraswap.server.observability.log_format import LOG_FORMATS

ENV_PREFIX = "LORASWAP_"


class SettingsError(ValueError):
    """Settings the server cannot start with (an incomplete flag combination, a file it names that is unusable).

    The message is one line that says what to change; `loraswap serve` prints it and exits 2.
    """


@dataclass(frozen=True)
class Settings:
    """Everything the server needs: where to listen, how long to drain, who may call, and the engine's config."""

    engine: EngineConfig
    host: str = "[::]"
    port: int = 50051
    grace_seconds: float = 30.0
    log_level: str = "INFO"
    # TLS: certificate chain and private key (PEM), re-read on SIGHUP; with them the server serves TLS only.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # mTLS: the CA bundle (PEM) client certificates must chain to; needs tls_cert and tls_key.
    tls_client_ca: Path | None = None
    # `ROLE TOKEN` lines, re-read on SIGHUP; with it every DiffusionService call needs a bearer token.
    auth_token_file: Path | None = None
    # Prometheus /metrics on this port (None: no metrics; 0: the OS picks, see RunningServer.metrics_port).
    metrics_port: int | None = None
    metrics_max_adapters: int = 100  # adapter label values of loraswap_adapter_requests_total; the rest: _other
    log_format: str = "text"  # or "json": one object per line
    log_prompts: bool = False  # prompts in the access log
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for Generate traces (the `otlp` extra)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("--tls-cert and --tls-key go together: give both to serve TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SettingsError("--tls-client-ca needs --tls-cert and --tls-key: client certificates need TLS")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise SettingsError(f"--metrics-port {self.metrics_port} is not a port; give 0 to 65535, or leave it out")
        if self.metrics_max_adapters < 0:
            raise SettingsError("--metrics-max-adapters must be 0 or more (0: every adapter counts as _other)")
        if self.log_format not in LOG_FORMATS:
            raise SettingsError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {self.log_format!r}")
        compile_problem = compile_options_problem(
            self.engine.compile, self.engine.compile_mode, self.engine.compile_backend
        )
        if compile_problem is not None:
            raise SettingsError(compile_problem)
        from loraswap.server.engine.pipeline.quantization import check_quantization  # imports torch: only when serving

        try:
            check_quantization(self.engine.quantize, self.engine.device)
        except ValueError as error:
            raise SettingsError(str(error)) from None
        if self.engine.device_adapter_bytes < 0:
            raise SettingsError(
                f"--device-adapter-bytes {self.engine.device_adapter_bytes} is negative; give a byte budget, or 0 "
                "for no adapters kept on the device"
            )
        if self.engine.attention is not None:
            from loraswap.server.engine.pipeline.attention import (
                check_attention,  # imports diffusers: only when asked for
            )

            try:
                check_attention(self.engine.attention, self.engine.device)
            except ValueError as error:
                raise SettingsError(str(error)) from None
        try:
            resolve_rank_buckets(self.engine.rank_buckets, self.engine.max_rank)
        except ValueError as error:
            raise SettingsError(str(error)) from None

    @property
    def serves_tls(self) -> bool:
        """Whether the server listens with TLS (and only with TLS)."""
        return self.tls_cert is not None


def _field_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _env_name(flag: str) -> str:
    return ENV_PREFIX + _field_name(flag).upper()


def _flag_defaults() -> dict[str, object]:
    """The default of each EngineConfig and Settings field, by field name: the one source of every flag's default."""
    return {
        field.name: field.default
        for config_class in (EngineConfig, Settings)
        for field in fields(config_class)
        if field.default is not MISSING
    }


def _bool_env(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_KIND_WORDS = {int: "an integer", float: "a number", _bool_env: "true or false (also 1/0, yes/no, on/off)"}


@dataclass(frozen=True)
class InvalidEnvironmentValue:
    """What a flag holds when its LORASWAP_* variable does not parse and the flag was not given.

    The parser is built for every `loraswap` command, so a bad variable must not fail there: `serve`
    refuses it in settings_from_args, with this one-line message; a flag given on the command line wins.
    """

    message: str

    def __str__(self) -> str:
        return "invalid, see the variable"


def _from_env(env_name: str, text: str, kind, choices) -> object:
    """The value of a LORASWAP_* variable for a flag, or an InvalidEnvironmentValue naming the variable."""
    try:
        value = kind(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
        expected = _KIND_WORDS.get(kind) or str(error)
        return InvalidEnvironmentValue(f"{env_name}={text[:100]!r} is not valid: expected {expected}; fix or unset it")
    if choices is not None and value not in choices:
        return InvalidEnvironmentValue(
            f"{env_name}={text[:100]!r} is not valid: expected one of {', '.join(map(str, choices))}; fix or unset it"
        )
    return value


def _help_with_default(help_text: str, value: object, env_name: str, from_env: bool) -> str:
    """The help text ending in the flag's default (unless the text already explains an unset one) and its variable."""
    if value is None or value == ():
        shown = None if "default:" in help_text else "none"
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    else:
        shown = str(value)
    if shown is not None:
        source = f", from {env_name}" if from_env else ""
        help_text = f"{help_text} (default: {shown}{source})"
    return f"{help_text} [env {env_name}]".replace("%", "%%")


def add_serve_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add the serve flags; each default comes from its LORASWAP_* variable when set."""
    env = os.environ if environ is None else environ
    # --max-rank defaults to EngineConfig.max_rank, --port to Settings.port, and so on.
    defaults = _flag_defaults()

    def flag(name: str, **kwargs) -> None:
        env_name = _env_name(name)
        env_value = env.get(env_name)
        kind = kwargs.get("type", str)
        if env_value is None:
            value = defaults[_field_name(name)]
        else:
            value = _from_env(env_name, env_value, kind, kwargs.get("choices"))
        help_text = _help_with_default(kwargs.pop("help", ""), value, env_name, env_value is not None)
        parser.add_argument(name, default=value, help=help_text, **kwargs)

    def switch(name: str, help_text: str) -> None:
        env_name = _env_name(name)
        env_value = env.get(env_name)
        if env_value is None:
            value = defaults[_field_name(name)]
        else:
            value = _from_env(env_name, env_value, _bool_env, None)
        parser.add_argument(
            name,
            default=value,
            action=argparse.BooleanOptionalAction,
            help=_help_with_default(help_text, value, env_name, env_value is not None),
        )

    flag("--model", help=f"built-in model ({', '.join(BUILTINS)}), a diffusers folder, or a Hub id")
    flag("--layers", type=int, help="random-flux only: keep N double-stream (2N single) blocks (default: all)")
    flag("--host", help="address to listen on")
    flag("--port", type=int, help="port to listen on; 0 lets the OS pick")
    flag(
        "--adapter-dir",
        help="directory of adapter files that requests may name (default: none; shapes: its shipped adapters)",
    )
    flag("--max-rank", type=int, help="highest adapter rank the swap slot takes")
    flag("--max-stack", type=int, help="most adapters one request may stack (their ranks share --max-rank)")
    flag(
        "--rank-buckets",
        type=_rank_buckets_arg,
        metavar="RANK,...",
        help="ascending ranks the slot computes at, each a graph compiled at warm-up: a request pays the smallest "
        "bucket holding its adapter's (a stack's summed) rank, the base model none (default: 16, 32, ... up to "
        "--max-rank; --max-rank is appended when missing)",
    )
    flag("--target-modules", help="comma-separated layer-name suffixes the slot covers (default: the family's)")
    flag(
        "--compile",
        type=normalize_compile,
        choices=COMPILE_KINDS,
        nargs="?",
        const="full",
        help="torch.compile the whole denoiser (full; --compile alone), only its repeated blocks (regional: "
        "compiles faster) or nothing (none; also --no-compile; true/false in the variable mean full/none) "
        "(default: full on CUDA, none on CPU)",
    )
    parser.add_argument(
        "--no-compile", dest="compile", action="store_const", const="none", default=parser.get_default("compile"),
        help="the same as --compile none",
    )  # fmt: skip
    flag("--compile-backend", choices=COMPILE_BACKENDS, help="torch.compile backend (eager, aot_eager: quick CPU runs)")
    flag(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="torch.compile mode, inductor only; off CUDA, reduce-overhead runs as default and max-autotune as "
        "max-autotune-no-cudagraphs (no CUDA graphs to capture)",
    )
    flag(
        "--compile-cache",
        metavar="DIR",
        help="keep torch's compiled artefacts (inductor, AOTAutograd) in DIR between starts, in a subfolder keyed by "
        "model, dtype, rank, slot layers, quantization, compile settings, torch version and device (default: "
        "torch's own temporary folder)",
    )
    flag(
        "--quantize",
        choices=QUANTIZATIONS,
        help="torchao storage of the denoiser's base linear weights (LoRA factors never): int8 weight-only "
        "(CPU and CUDA) or fp8 (CUDA, compute capability 8.9+)",
    )
    flag(
        "--attention",
        metavar="BACKEND",
        help="diffusers attention backend of the denoiser (diffusers' AttentionBackendName: native, flash, "
        "_flash_3, flex, sage, xformers, ...); off CUDA the native one runs (default: the fastest installed on "
        "CUDA, FlashAttention 3 on Hopper when installed, else native)",
    )
    flag("--device", help="torch device (default: cuda when available, else cpu)")
    flag(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="the model's dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    switch("--allow-hub", "let adapter names fall back to Hugging Face Hub repo ids")
    flag(
        "--allow-base",
        help="comma-separated further base models (Hub ids, e.g. black-forest-labs/FLUX.1-schnell) whose adapters "
        "this server accepts, beside those made for the model it serves",
    )
    switch("--strict-adapters", "refuse adapters with text-encoder layers instead of dropping them")
    flag("--max-adapter-bytes", type=int, help="largest adapter file accepted")
    flag("--adapter-cache-bytes", type=int, help="host-memory budget of the adapter cache (pinned adapters count)")
    flag(
        "--device-adapter-bytes",
        type=int,
        help="CUDA: device memory for the most recently swapped adapters, so that a swap between them is a copy "
        "within the device; 0: none (off CUDA: always none)",
    )
    flag(
        "--preload",
        metavar="NAME,...",
        help="comma-separated adapters to load before the server turns SERVING; start-up fails on one it cannot load",
    )
    flag(
        "--pin",
        metavar="NAME,...",
        help="comma-separated adapters to preload and keep out of LRU eviction (Evict refuses them)",
    )
    flag("--max-queue", type=int, help="most requests that may wait")
    flag("--max-bypass", type=int, help="times a request may be passed over for one needing no swap (0: FIFO)")
    flag("--max-size", type=int, help="largest width or height accepted")
    flag("--torch-threads", type=int, help="torch CPU threads (default: the cores this process may use)")
    flag("--grace-seconds", type=float, help="how long running work may finish on SIGTERM")
    flag("--log-level", type=str.upper, choices=LOG_LEVELS, help="logging level")
    flag("--log-format", choices=LOG_FORMATS, help="text (readable lines) or json (one JSON object per line)")
    switch("--log-prompts", "write each Generate's prompt in its access log line")
    flag("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: the OS picks; default: off)")
    flag(
        "--metrics-max-adapters",
        type=int,
        help="most adapter names labelled in loraswap_adapter_requests_total; the rest count as adapter=_other",
    )
    flag(
        "--otlp-endpoint",
        help="OTLP/gRPC collector for Generate traces, e.g. http://localhost:4317 (the otlp extra; default: off)",
    )
    flag("--tls-cert", help="PEM certificate chain: serve TLS only (needs --tls-key; re-read on SIGHUP)")
    flag("--tls-key", help="PEM private key of --tls-cert (re-read on SIGHUP)")
    flag("--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (mTLS)")
    flag("--auth-token-file", help="file of `ROLE TOKEN` lines (roles: generate, admin): require bearer tokens")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The frozen Settings for parsed serve flags.

    Raises:
        SettingsError: a LORASWAP_* variable did not parse (and its flag was not given), or the flags conflict.
    """
    for value in vars(args).values():
        if isinstance(value, InvalidEnvironmentValue):
            raise SettingsError(value.message)
    targets = tuple(t.strip() for t in args.target_modules.split(",") if t.strip()) if args.target_modules else None
    return Settings(
        engine=EngineConfig(
            model=args.model,
            layers=args.layers,
            device=args.device,
            dtype=args.dtype,
            max_rank=args.max_rank,
            max_stack=args.max_stack,
            rank_buckets=args.rank_buckets,
            target_modules=targets,
            compile=args.compile,
            compile_backend=args.compile_backend,
            compile_mode=args.compile_mode,
            compile_cache=_optional_path(args.compile_cache),
            quantize=args.quantize,
            attention=args.attention or None,
            adapter_dir=Path(args.adapter_dir) if args.adapter_dir else None,
            allow_hub=args.allow_hub,
            allow_base=_names(args.allow_base),
            strict_adapters=args.strict_adapters,
            max_adapter_bytes=args.max_adapter_bytes,
            adapter_cache_bytes=args.adapter_cache_bytes,
            device_adapter_bytes=args.device_adapter_bytes,
            preload=_names(args.preload),
            pin=_names(args.pin),
            max_queue=args.max_queue,
            max_bypass=args.max_bypass,
            max_size=args.max_size,
            torch_threads=args.torch_threads,
        ),
        host=args.host,
        port=args.port,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
        tls_cert=_optional_path(args.tls_cert),
        tls_key=_optional_path(args.tls_key),
        tls_client_ca=_optional_path(args.tls_client_ca),
        auth_token_file=_optional_path(args.auth_token_file),
        metrics_port=args.metrics_port,
        metrics_max_adapters=args.metrics_max_adapters,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
        otlp_endpoint=args.otlp_endpoint or None,
    )


def _names(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """`a,b` (a flag or variable) -> ("a", "b"); the default () as it is."""
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    return tuple(value)


def _rank_buckets_arg(text: str) -> tuple[int, ...] | None:
    """--rank-buckets 16,32,64 -> (16, 32, 64); empty: None, the default (checked against --max-rank in Settings)."""
    try:
        return parse_rank_buckets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _optional_path(value: str | None) -> Path | None:
    # An empty LORASWAP_* variable means "not set", as an absent one does.
    return Path(value) if value else None
