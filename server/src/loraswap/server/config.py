"""`loraswap serve` settings: one frozen object built from flags, each with a LORASWAP_* environment twin.

Every setting is one dataclass field, of Settings here or of the engine's EngineConfig, declared
with `setting(...)` (loraswap.server.engine.config): its name, default, parsing, choices and help.
The argument parser, the reading of the environment and the Settings object are all derived from
those fields, so a new setting is one field in one place.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loraswap.server.engine.config import (
    EngineConfig,
    SettingsError,
    SettingSpec,
    optional_path,
    optional_text,
    setting,
    setting_fields,
)

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "Settings", "SettingsError", "add_serve_arguments", "settings_from_args"]

ENV_PREFIX = "LORASWAP_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# --log-format: readable text lines, or one JSON object per line (observability/log_format.py writes both).
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class Settings:
    """Everything the server needs: where to listen, how long to drain, who may call, and the engine's config."""

    engine: EngineConfig
    host: str = setting("[::]", "address to listen on")
    port: int = setting(50051, "port to listen on; 0 lets the OS pick", parse=int)
    grace_seconds: float = setting(
        30.0,
        "how long running work may finish on SIGTERM or SIGINT (and a start-up under way may take to reach a point "
        "where it can stop); a second signal ends the wait",
        parse=float,
    )
    log_level: str = setting("INFO", "logging level", parse=str.upper, choices=LOG_LEVELS)
    log_format: str = setting("text", "text (readable lines) or json (one JSON object per line)", choices=LOG_FORMATS)
    log_prompts: bool = setting(False, "write each Generate's prompt in its access log line", switch=True)
    # Prometheus /metrics on this port (None: no metrics; 0: the OS picks, see RunningServer.metrics_port).
    metrics_port: int | None = setting(
        None, "serve Prometheus /metrics on this port (0: the OS picks; default: off)", parse=int
    )
    # Adapter label values of loraswap_adapter_requests_total; the rest: _other.
    metrics_max_adapters: int = setting(
        100,
        "most adapter names labelled in loraswap_adapter_requests_total; the rest count as adapter=_other",
        parse=int,
    )
    # The OTLP/gRPC collector for Generate traces (the `otlp` extra).
    otlp_endpoint: str | None = setting(
        None,
        "OTLP/gRPC collector for Generate traces, e.g. http://localhost:4317 (the otlp extra; default: off)",
        parse=optional_text,
    )
    # TLS: certificate chain and private key (PEM), re-read on SIGHUP; with them the server serves TLS only.
    tls_cert: Path | None = setting(
        None, "PEM certificate chain: serve TLS only (needs --tls-key; re-read on SIGHUP)", parse=optional_path
    )
    tls_key: Path | None = setting(None, "PEM private key of --tls-cert (re-read on SIGHUP)", parse=optional_path)
    # mTLS: the CA bundle (PEM) client certificates must chain to; needs tls_cert and tls_key.
    tls_client_ca: Path | None = setting(
        None, "PEM CA bundle: require client certificates signed by it (mTLS)", parse=optional_path
    )
    # `ROLE TOKEN` lines, re-read on SIGHUP; with it every DiffusionService call needs a bearer token.
    auth_token_file: Path | None = setting(
        None,
        "file of `ROLE TOKEN` lines (roles: generate, admin): require bearer tokens",
        parse=optional_path,
    )

    def __post_init__(self) -> None:
        """Refuse front-end combinations that cannot work, in one line (the engine checks its own config)."""
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

    @property
    def serves_tls(self) -> bool:
        """Whether the server listens with TLS (and only with TLS)."""
        return self.tls_cert is not None


def _bool_env(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _from_env(env_name: str, text: str, parse, choices) -> object:
    """The value of a LORASWAP_* variable for a setting, or an InvalidEnvironmentValue naming the variable."""
    try:
        value = parse(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
        expected = _KIND_WORDS.get(parse) or str(error)
        return InvalidEnvironmentValue(f"{env_name}={text[:100]!r} is not valid: expected {expected}; fix or unset it")
    if choices is not None and value not in choices:
        return InvalidEnvironmentValue(
            f"{env_name}={text[:100]!r} is not valid: expected one of {', '.join(map(str, choices))}; fix or unset it"
        )
    return value


def _flag_type(parse):
    """argparse's `type` for a parse function: its own one-line message for a value it refuses (argparse would
    only say "invalid <function> value"); int and float keep argparse's usual words."""
    if parse in (str, int, float):
        return parse

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


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


def _each(parse):
    """A repeatable setting's variable: comma-separated values, each read by `parse`."""

    def parse_each(text: str) -> tuple:
        return tuple(parse(item.strip()) for item in text.split(",") if item.strip())

    return parse_each


class _Repeated(argparse.Action):
    """A repeatable flag: its values in order, as a tuple; given at all, the flags replace the variable's values."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        start = () if current is self.default else tuple(current)
        setattr(namespace, self.dest, start + (values,))


def _add_setting(parser: argparse.ArgumentParser, name: str, default: object, spec: SettingSpec, env) -> None:
    """One setting's flag (and its --no- twin), its default taken from its LORASWAP_* variable when set."""
    env_name = _env_name(name)
    env_value = env.get(env_name)
    parse = _bool_env if spec.switch else _each(spec.parse) if spec.repeatable else spec.parse
    value = default if env_value is None else _from_env(env_name, env_value, parse, spec.choices)
    help_text = _help_with_default(spec.help, value, env_name, env_value is not None)
    flag = _flag(name)
    if spec.switch:
        parser.add_argument(flag, default=value, action=argparse.BooleanOptionalAction, help=help_text)
        return
    if spec.repeatable:
        options = dict(default=value, type=_flag_type(spec.parse), help=help_text, action=_Repeated)
        parser.add_argument(flag, metavar=spec.metavar, **options)
        return
    options: dict = dict(default=value, type=_flag_type(spec.parse), help=help_text)
    if spec.choices is not None:
        options["choices"] = spec.choices
    if spec.metavar is not None:
        options["metavar"] = spec.metavar
    if spec.const is not None:
        options.update(nargs="?", const=spec.const)
    parser.add_argument(flag, **options)
    if spec.negated is not None:
        negated_value, negated_help = spec.negated
        parser.add_argument(
            "--no-" + flag.removeprefix("--"), dest=name, action="store_const", const=negated_value,
            default=value, help=negated_help,
        )  # fmt: skip


def add_serve_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add a flag for every setting of EngineConfig and Settings; each default comes from its LORASWAP_* variable
    when set, else from the dataclass."""
    env = os.environ if environ is None else environ
    for config_class in (EngineConfig, Settings):
        for item, spec in setting_fields(config_class):
            _add_setting(parser, item.name, item.default, spec, env)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The frozen Settings for parsed serve flags.

    Raises:
        SettingsError: a LORASWAP_* variable did not parse (and its flag was not given), or the settings conflict
            or name what this server cannot run (one line that says what to change).
    """
    for value in vars(args).values():
        if isinstance(value, InvalidEnvironmentValue):
            raise SettingsError(value.message)

    def values(config_class: type) -> dict[str, object]:
        return {item.name: getattr(args, item.name) for item, _ in setting_fields(config_class)}

    return Settings(engine=EngineConfig(**values(EngineConfig)), **values(Settings))
