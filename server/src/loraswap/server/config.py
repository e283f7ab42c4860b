"""`loraswap serve` settings: one frozen object built from flags, each with a LORASWAP_* environment twin."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.models import BUILTINS

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

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("--tls-cert and --tls-key go together: give both to serve TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SettingsError("--tls-client-ca needs --tls-cert and --tls-key: client certificates need TLS")

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


def add_serve_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add the serve flags; each default comes from its LORASWAP_* variable when set."""
    env = os.environ if environ is None else environ
    # --max-rank defaults to EngineConfig.max_rank, --port to Settings.port, and so on.
    defaults = _flag_defaults()

    def flag(name: str, **kwargs) -> None:
        env_value = env.get(_env_name(name))
        kind = kwargs.get("type", str)
        value = kind(env_value) if env_value is not None else defaults[_field_name(name)]
        help_text = kwargs.pop("help", "")
        parser.add_argument(name, default=value, help=f"{help_text} [env {_env_name(name)}]", **kwargs)

    def switch(name: str, help_text: str) -> None:
        env_value = env.get(_env_name(name))
        value = _bool_env(env_value) if env_value is not None else defaults[_field_name(name)]
        parser.add_argument(
            name, default=value, action=argparse.BooleanOptionalAction, help=f"{help_text} [env {_env_name(name)}]"
        )

    flag("--model", help=f"built-in model ({', '.join(BUILTINS)}), a diffusers folder, or a Hub id")
    flag("--layers", type=int, help="random-flux only: keep N double-stream (2N single) blocks")
    flag("--host", help="address to listen on")
    flag("--port", type=int, help="port to listen on; 0 lets the OS pick")
    flag("--adapter-dir", help="directory of adapter files that requests may name")
    flag("--max-rank", type=int, help="highest adapter rank the swap slot takes")
    flag("--max-stack", type=int, help="most adapters one request may stack (their ranks share --max-rank)")
    flag("--target-modules", help="comma-separated layer-name suffixes the slot covers (default: the family's)")
    switch("--compile", "torch.compile the denoiser (default: on for CUDA, off on CPU)")
    flag("--compile-backend", help="torch.compile backend (inductor, aot_eager, eager)")
    flag("--device", help="torch device (default: cuda when available, else cpu)")
    flag("--dtype", help="float32, float16 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)")
    switch("--allow-hub", "let adapter names fall back to Hugging Face Hub repo ids")
    switch("--strict-adapters", "refuse adapters with text-encoder layers instead of dropping them")
    flag("--max-adapter-bytes", type=int, help="largest adapter file accepted")
    flag("--adapter-cache-bytes", type=int, help="host-memory budget of the adapter cache")
    flag("--max-queue", type=int, help="most requests that may wait")
    flag("--max-bypass", type=int, help="times a request may be passed over for one needing no swap (0: FIFO)")
    flag("--max-size", type=int, help="largest width or height accepted")
    flag("--torch-threads", type=int, help="torch CPU threads (default: the cores this process may use)")
    flag("--grace-seconds", type=float, help="how long running work may finish on SIGTERM")
    flag("--log-level", help="logging level")
    flag("--tls-cert", help="PEM certificate chain: serve TLS only (needs --tls-key; re-read on SIGHUP)")
    flag("--tls-key", help="PEM private key of --tls-cert (re-read on SIGHUP)")
    flag("--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (mTLS)")
    flag("--auth-token-file", help="file of `ROLE TOKEN` lines (roles: generate, admin): require bearer tokens")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The frozen Settings for parsed serve flags."""
    targets = tuple(t.strip() for t in args.target_modules.split(",") if t.strip()) if args.target_modules else None
    return Settings(
        engine=EngineConfig(
            model=args.model,
            layers=args.layers,
            device=args.device,
            dtype=args.dtype,
            max_rank=args.max_rank,
            max_stack=args.max_stack,
            target_modules=targets,
            compile=args.compile,
            compile_backend=args.compile_backend,
            adapter_dir=Path(args.adapter_dir) if args.adapter_dir else None,
            allow_hub=args.allow_hub,
            strict_adapters=args.strict_adapters,
            max_adapter_bytes=args.max_adapter_bytes,
            adapter_cache_bytes=args.adapter_cache_bytes,
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
    )


def _optional_path(value: str | None) -> Path | None:
    # An empty LORASWAP_* variable means "not set", as an absent one does.
    return Path(value) if value else None
