"""`loraswap serve` settings: flags, their LORASWAP_* environment twins, and which one wins."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from loraswap.server.config import Settings, SettingsError, add_serve_arguments, settings_from_args
from loraswap.server.engine.config import DEFAULT_ADAPTER_CACHE_BYTES, DEFAULT_MAX_ADAPTER_BYTES, EngineConfig


def _settings(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={} if environ is None else environ)
    return settings_from_args(parser.parse_args(argv))


def _engine(**changes) -> EngineConfig:
    return EngineConfig(**changes)


# flag, its environment variable, the text given to either, and the Settings it must produce
OPTIONS = [
    ("--model", "LORASWAP_MODEL", "tiny-sdxl", Settings(engine=_engine(model="tiny-sdxl"))),
    ("--host", "LORASWAP_HOST", "127.0.0.1", Settings(engine=_engine(), host="127.0.0.1")),
    ("--port", "LORASWAP_PORT", "0", Settings(engine=_engine(), port=0)),
    ("--adapter-dir", "LORASWAP_ADAPTER_DIR", "/srv/adapters",
     Settings(engine=_engine(adapter_dir=Path("/srv/adapters")))),
    ("--max-rank", "LORASWAP_MAX_RANK", "128", Settings(engine=_engine(max_rank=128))),
    ("--max-stack", "LORASWAP_MAX_STACK", "2", Settings(engine=_engine(max_stack=2))),
    ("--rank-buckets", "LORASWAP_RANK_BUCKETS", "8, 32,64", Settings(engine=_engine(rank_buckets=(8, 32, 64)))),
    ("--target-modules", "LORASWAP_TARGET_MODULES", "to_q, to_k,,to_out.0",
     Settings(engine=_engine(target_modules=("to_q", "to_k", "to_out.0")))),
    ("--compile", "LORASWAP_COMPILE", "regional", Settings(engine=_engine(compile="regional"))),
    ("--compile-backend", "LORASWAP_COMPILE_BACKEND", "aot_eager",
     Settings(engine=_engine(compile_backend="aot_eager"))),
    ("--compile-mode", "LORASWAP_COMPILE_MODE", "max-autotune", Settings(engine=_engine(compile_mode="max-autotune"))),
    ("--quantize", "LORASWAP_QUANTIZE", "int8wo", Settings(engine=_engine(quantize="int8wo"))),
    ("--fuse", "LORASWAP_FUSE", "always", Settings(engine=_engine(fuse="always"))),
    ("--fuse-memory-bytes", "LORASWAP_FUSE_MEMORY_BYTES", "4000", Settings(engine=_engine(fuse_memory_bytes=4000))),
    ("--text-encoder-layers", "LORASWAP_TEXT_ENCODER_LAYERS", "ignore",
     Settings(engine=_engine(text_encoder_layers="ignore"))),
    ("--compile-cache", "LORASWAP_COMPILE_CACHE", "/var/cache/loraswap",
     Settings(engine=_engine(compile_cache=Path("/var/cache/loraswap")))),
    ("--device", "LORASWAP_DEVICE", "cuda:1", Settings(engine=_engine(device="cuda:1"))),
    ("--dtype", "LORASWAP_DTYPE", "bfloat16", Settings(engine=_engine(dtype="bfloat16"))),
    ("--allow-base", "LORASWAP_ALLOW_BASE", "black-forest-labs/FLUX.1-schnell, ,my-org/flux-finetune",
     Settings(engine=_engine(allow_base=("black-forest-labs/FLUX.1-schnell", "my-org/flux-finetune")))),
    ("--max-adapter-bytes", "LORASWAP_MAX_ADAPTER_BYTES", "1000", Settings(engine=_engine(max_adapter_bytes=1000))),
    ("--adapter-cache-bytes", "LORASWAP_ADAPTER_CACHE_BYTES", "2000",
     Settings(engine=_engine(adapter_cache_bytes=2000))),
    ("--device-adapter-bytes", "LORASWAP_DEVICE_ADAPTER_BYTES", "3000",
     Settings(engine=_engine(device_adapter_bytes=3000))),
    ("--attention", "LORASWAP_ATTENTION", "native", Settings(engine=_engine(attention="native"))),
    ("--preload", "LORASWAP_PRELOAD", "outline, ,styles/ink", Settings(engine=_engine(preload=("outline", "styles/ink")))),
    ("--pin", "LORASWAP_PIN", "outline,purple", Settings(engine=_engine(pin=("outline", "purple")))),
    ("--max-queue", "LORASWAP_MAX_QUEUE", "3", Settings(engine=_engine(max_queue=3))),
    ("--max-bypass", "LORASWAP_MAX_BYPASS", "0", Settings(engine=_engine(max_bypass=0))),
    ("--layers", "LORASWAP_LAYERS", "8", Settings(engine=_engine(layers=8))),
    ("--max-size", "LORASWAP_MAX_SIZE", "512", Settings(engine=_engine(max_size=512))),
    ("--torch-threads", "LORASWAP_TORCH_THREADS", "2", Settings(engine=_engine(torch_threads=2))),
    ("--grace-seconds", "LORASWAP_GRACE_SECONDS", "2.5", Settings(engine=_engine(), grace_seconds=2.5)),
    ("--log-level", "LORASWAP_LOG_LEVEL", "DEBUG", Settings(engine=_engine(), log_level="DEBUG")),
    ("--auth-token-file", "LORASWAP_AUTH_TOKEN_FILE", "/etc/loraswap/tokens",
     Settings(engine=_engine(), auth_token_file=Path("/etc/loraswap/tokens"))),
    ("--metrics-port", "LORASWAP_METRICS_PORT", "9090", Settings(engine=_engine(), metrics_port=9090)),
    ("--metrics-max-adapters", "LORASWAP_METRICS_MAX_ADAPTERS", "5", Settings(engine=_engine(), metrics_max_adapters=5)),
    ("--log-format", "LORASWAP_LOG_FORMAT", "json", Settings(engine=_engine(), log_format="json")),
    ("--otlp-endpoint", "LORASWAP_OTLP_ENDPOINT", "http://collector:4317",
     Settings(engine=_engine(), otlp_endpoint="http://collector:4317")),
    ("--allow-url-host", "LORASWAP_ALLOW_URL_HOST", "*.S3.amazonaws.com",
     Settings(engine=_engine(allow_url_host=("*.s3.amazonaws.com",)))),
    ("--allow-insecure-url-host", "LORASWAP_ALLOW_INSECURE_URL_HOST", "127.0.0.1",
     Settings(engine=_engine(allow_insecure_url_host=("127.0.0.1",)))),
    ("--url-ca-file", "LORASWAP_URL_CA_FILE", "/etc/ssl/private-ca.pem",
     Settings(engine=_engine(url_ca_file=Path("/etc/ssl/private-ca.pem")))),
    ("--adapter-cache-dir", "LORASWAP_ADAPTER_CACHE_DIR", "/var/cache/adapters",
     Settings(engine=_engine(adapter_cache_dir=Path("/var/cache/adapters")))),
    ("--adapter-cache-dir-bytes", "LORASWAP_ADAPTER_CACHE_DIR_BYTES", "5000",
     Settings(engine=_engine(adapter_cache_dir_bytes=5000))),
    ("--url-timeout-seconds", "LORASWAP_URL_TIMEOUT_SECONDS", "2.5", Settings(engine=_engine(url_timeout_seconds=2.5))),
    ("--url-deadline-seconds", "LORASWAP_URL_DEADLINE_SECONDS", "60",
     Settings(engine=_engine(url_deadline_seconds=60.0))),
]  # fmt: skip

# Flags whose values must name something real; tested on their own below.
OWN_TESTS = {"--url-token-file"}

# --no-compile is --compile none (tests/unit/test_compile_options.py has every form of --compile)
ALIASES = {"--no-compile"}

# on/off switches: --x / --no-x, and LORASWAP_X=true/false
SWITCHES = [
    ("allow-hub", "LORASWAP_ALLOW_HUB", "allow_hub"),
    ("strict-adapters", "LORASWAP_STRICT_ADAPTERS", "strict_adapters"),
    ("allow-url-private-addresses", "LORASWAP_ALLOW_URL_PRIVATE_ADDRESSES", "allow_url_private_addresses"),
    ("log-prompts", "LORASWAP_LOG_PROMPTS", "log_prompts"),  # a Settings field, not an EngineConfig one
]


def test_defaults() -> None:
    settings = _settings([])
    assert settings == Settings(engine=EngineConfig())
    assert settings.engine.compile is None  # decided by the device later, not forced on or off
    assert (settings.port, settings.host, settings.grace_seconds) == (50051, "[::]", 30.0)
    assert settings.engine.max_adapter_bytes == DEFAULT_MAX_ADAPTER_BYTES
    assert settings.engine.adapter_cache_bytes == DEFAULT_ADAPTER_CACHE_BYTES


def test_every_flag_default_is_its_dataclass_default() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={})
    defaults = {
        field.name: field.default
        for config_class in (EngineConfig, Settings)
        for field in fields(config_class)
        if field.default is not MISSING
    }
    flags = [action for action in parser._actions if action.dest != "help"]
    assert {action.dest for action in flags} <= set(defaults)  # each flag fills a field of the same name
    for action in flags:
        assert action.default == defaults[action.dest], action.option_strings[0]


def test_every_flag_is_covered_here() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={})
    flags = {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}
    covered = (
        {flag for flag, *_ in OPTIONS}
        | {f"--{name}" for name, *_ in SWITCHES}
        | {f"--no-{name}" for name, *_ in SWITCHES}
        | ALIASES
        | OWN_TESTS
        | {flag for argv, *_ in TLS_COMBINATIONS for flag in argv if flag.startswith("--")}
    )
    assert flags == covered


# The TLS flags only make sense together, so they are tested as combinations: flags, environment, and the
# Settings they must produce.
TLS = {"tls_cert": Path("/tls/server.crt"), "tls_key": Path("/tls/server.key")}
TLS_COMBINATIONS = [
    (["--tls-cert", "/tls/server.crt", "--tls-key", "/tls/server.key"], {}, Settings(engine=_engine(), **TLS)),
    (["--tls-cert", "/tls/server.crt", "--tls-key", "/tls/server.key", "--tls-client-ca", "/tls/clients.pem"], {},
     Settings(engine=_engine(), tls_client_ca=Path("/tls/clients.pem"), **TLS)),
    ([], {"LORASWAP_TLS_CERT": "/tls/server.crt", "LORASWAP_TLS_KEY": "/tls/server.key",
          "LORASWAP_TLS_CLIENT_CA": "/tls/clients.pem"},
     Settings(engine=_engine(), tls_client_ca=Path("/tls/clients.pem"), **TLS)),
    (["--tls-cert", "/tls/server.crt"], {"LORASWAP_TLS_CERT": "/old.crt", "LORASWAP_TLS_KEY": "/tls/server.key"},
     Settings(engine=_engine(), **TLS)),
    ([], {"LORASWAP_TLS_CERT": "", "LORASWAP_TLS_KEY": "", "LORASWAP_TLS_CLIENT_CA": ""}, Settings(engine=_engine())),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "environ", "expected"), TLS_COMBINATIONS)
def test_tls_flags_and_their_environment_twins(argv: list[str], environ: dict[str, str], expected: Settings) -> None:
    settings = _settings(argv, environ)
    assert settings == expected
    assert settings.serves_tls is (expected.tls_cert is not None)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tls-cert", "/tls/server.crt"], "--tls-key"),
        (["--tls-key", "/tls/server.key"], "--tls-cert"),
        (["--tls-client-ca", "/tls/clients.pem"], "--tls-client-ca"),
        (["--tls-client-ca", "/tls/clients.pem", "--tls-key", "/tls/server.key"], "--tls-cert"),
    ],
)
def test_incomplete_tls_flags_are_refused_in_one_line(argv: list[str], named: str) -> None:
    with pytest.raises(SettingsError) as refused:
        _settings(argv)
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("flag", "env", "text", "expected"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_flag(flag: str, env: str, text: str, expected: Settings) -> None:
    assert _settings([flag, text]) == expected


@pytest.mark.parametrize(("flag", "env", "text", "expected"), OPTIONS, ids=[o[1] for o in OPTIONS])
def test_environment_sets_the_default(flag: str, env: str, text: str, expected: Settings) -> None:
    assert _settings([], {env: text}) == expected


@pytest.mark.parametrize(("flag", "env", "text", "expected"), OPTIONS, ids=[o[0] for o in OPTIONS])
def test_flag_overrides_environment(flag: str, env: str, text: str, expected: Settings) -> None:
    other = {"--port": "7", "--max-rank": "8", "--max-stack": "9", "--max-adapter-bytes": "9", "--adapter-cache-bytes": "9",
             "--max-queue": "9", "--max-bypass": "9", "--fuse-memory-bytes": "9", "--layers": "9", "--max-size": "9", "--torch-threads": "9", "--grace-seconds": "9.0"}  # fmt: skip
    assert _settings([flag, text], {env: other.get(flag, "from-environment")}) == expected


@pytest.mark.parametrize(("name", "env", "field"), SWITCHES, ids=[s[0] for s in SWITCHES])
@pytest.mark.parametrize(
    ("argv_form", "env_value", "expected"),
    [
        ("--{}", None, True),
        ("--no-{}", None, False),
        (None, "true", True),
        (None, "1", True),
        (None, "yes", True),
        (None, "On", True),
        (None, "false", False),
        (None, "0", False),
        (None, "no", False),
        (None, " OFF ", False),
        ("--no-{}", "true", False),  # the flag wins
        ("--{}", "false", True),
    ],
)
def test_switch(name: str, env: str, field: str, argv_form: str | None, env_value: str | None, expected: bool):
    argv = [argv_form.format(name)] if argv_form else []
    environ = {env: env_value} if env_value is not None else {}
    settings = _settings(argv, environ)
    assert getattr(settings.engine if hasattr(settings.engine, field) else settings, field) is expected


def test_switch_defaults() -> None:
    engine = _settings([]).engine
    assert (engine.compile, engine.allow_hub, engine.strict_adapters) == (None, False, False)


@pytest.mark.parametrize(
    "environ", [{"LORASWAP_COMPILE": "maybe"}, {"LORASWAP_PORT": "fifty"}, {"LORASWAP_GRACE_SECONDS": "soon"}]
)
def test_bad_environment_value_is_refused(environ: dict[str, str]) -> None:
    with pytest.raises(SettingsError) as refused:
        _settings([], environ)
    (variable,) = environ
    assert str(refused.value).startswith(f"{variable}=") and "\n" not in str(refused.value)


def test_explicit_environ_ignores_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASWAP_PORT", "1234")
    assert _settings([], {}).port == 50051


def test_process_environment_is_the_default_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASWAP_PORT", "1234")
    monkeypatch.setenv("LORASWAP_ALLOW_HUB", "true")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    settings = settings_from_args(parser.parse_args([]))
    assert (settings.port, settings.engine.allow_hub) == (1234, True)


def test_unrelated_environment_is_ignored() -> None:
    assert _settings([], {"PORT": "1", "LORASWAP_UNKNOWN": "x", "loraswap_port": "2"}) == _settings([])


def test_help_names_each_environment_variable() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={})
    helps = {option: action.help for action in parser._actions for option in action.option_strings}
    for flag, env, *_ in OPTIONS:
        assert helps[flag].endswith(f"[env {env}]")
    for name, env, _ in SWITCHES:
        assert helps[f"--{name}"].endswith(f"[env {env}]")


def test_settings_are_frozen() -> None:
    settings = _settings([])
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.engine.max_rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--fuse", "always", "--quantize", "int8wo"], "--fuse auto"),
        (["--fuse-memory-bytes", "-1"], "--fuse-memory-bytes"),
        (["--torch-threads", "-1"], "--torch-threads"),
    ],
)
def test_fuse_settings_the_engine_cannot_run_are_refused_in_one_line(argv: list[str], named: str) -> None:
    with pytest.raises(SettingsError) as refused:
        _settings(argv)
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("fuse", "quantize", "fuses"),
    [
        ("auto", "none", True), ("always", "none", True), ("never", "none", False),
        # fp8 weights are requantized in place from pristine copies: both policies that merge, merge them.
        ("auto", "fp8", True), ("always", "fp8", True), ("never", "fp8", False),
        # int8 weight-only weights are served unfused only (always is refused above).
        ("auto", "int8wo", False), ("never", "int8wo", False),
    ],
)  # fmt: skip
def test_fp8_weights_fuse_and_int8_weight_only_ones_are_served_unfused(fuse, quantize, fuses) -> None:
    assert _settings(["--fuse", fuse, "--quantize", quantize]).engine.fuses is fuses


def test_fuse_always_with_int8_weight_only_says_what_does_fuse() -> None:
    with pytest.raises(SettingsError) as refused:
        _settings(["--fuse", "always", "--quantize", "int8wo"])
    assert "unfused only" in str(refused.value) and "--quantize none or fp8" in str(refused.value)


def test_fuse_defaults_to_auto_and_is_one_of_three() -> None:
    assert _settings([]).engine.fuse == "auto"
    with pytest.raises(SystemExit):
        _settings(["--fuse", "sometimes"])


def test_a_repeatable_flag_collects_its_values_and_replaces_the_variables() -> None:
    environ = {"LORASWAP_ALLOW_URL_HOST": "huggingface.co, *.r2.dev"}
    assert _settings([], environ).engine.allow_url_host == ("huggingface.co", "*.r2.dev")
    flags = ["--allow-url-host", "a.example.com", "--allow-url-host", "*.B.example.com"]
    assert _settings(flags, environ).engine.allow_url_host == ("a.example.com", "*.b.example.com")


@pytest.mark.parametrize("host", ["https://example.com", "example.com/path", "example.com:443", "*", "a.*.com", ""])
def test_a_url_host_is_a_bare_name_domain_or_address(host: str, capsys) -> None:
    with pytest.raises(SystemExit):
        _settings(["--allow-url-host", host])
    assert "--allow-url-host" in capsys.readouterr().err


def test_the_url_token_file_is_read_at_start_and_never_quoted(tmp_path, monkeypatch) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# model sites\nhuggingface.co hf_secret\n*.example.com env:EXAMPLE_TOKEN\n")
    monkeypatch.setenv("EXAMPLE_TOKEN", "from-the-environment")
    settings = _settings(["--url-token-file", str(tokens)])
    assert settings.engine.url_token_file == tokens
    from loraswap.server.engine.adapters.sources import read_token_file

    assert read_token_file(tokens) == {"huggingface.co": "hf_secret", "*.example.com": "from-the-environment"}
    monkeypatch.delenv("EXAMPLE_TOKEN")
    with pytest.raises(SettingsError, match="EXAMPLE_TOKEN") as refused:
        _settings(["--url-token-file", str(tokens)])
    assert "hf_secret" not in str(refused.value)
    tokens.write_text("huggingface.co hf_secret extra\n")
    with pytest.raises(SettingsError, match=":1: expected") as refused:
        _settings(["--url-token-file", str(tokens)])
    assert "hf_secret" not in str(refused.value)
    with pytest.raises(SettingsError, match="--url-token-file"):
        _settings(["--url-token-file", str(tmp_path / "missing")])
    tokens.write_text("abc/def:ghi== huggingface.co\n")  # the fields swapped: the token is never quoted
    with pytest.raises(SettingsError, match=":1: the first field") as refused:
        _settings(["--url-token-file", str(tokens)])
    assert "abc/def" not in str(refused.value)
