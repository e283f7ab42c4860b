"""The `loraswap` console script as users run it: --version, `serve --help`, bad LORASWAP_* values, --preload.

Each runs the installed script (or `python -m loraswap.client.command`, the same entry point) in a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from tests.support.servers import TEST_TORCH_THREADS

SCRIPT = Path(sys.executable).with_name("loraswap")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "LORASWAP_TORCH_THREADS": str(TEST_TORCH_THREADS), **(env or {})},
    )  # fmt: skip


def test_version_names_the_client_and_the_installed_server_even_with_a_bad_variable() -> None:
    # A bad LORASWAP_* value concerns `serve` only: it must not break building the command line.
    result = _run("--version", env={"LORASWAP_PORT": "abc"})
    assert result.returncode == 0, result.stderr[-2000:]
    expected = f"loraswap-client {version('loraswap-client')}, loraswap-server {version('loraswap-server')}"
    assert result.stdout.strip() == expected


def test_serve_help_shows_defaults_choices_and_variables() -> None:
    result = _run("serve", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    for expected in ("--port PORT", "(default: 50051) [env LORASWAP_PORT]", "--dtype {float32,float16,bfloat16}",
                     "--log-level {DEBUG,INFO,WARNING,ERROR,CRITICAL}", "(default: none) [env LORASWAP_PRELOAD]",
                     "--pin NAME,...", "(default: off) [env LORASWAP_ALLOW_HUB]"):  # fmt: skip
        assert expected in text, expected


def test_bad_environment_value_fails_serve_with_one_line_naming_it() -> None:
    for variable, text in (("LORASWAP_PORT", "abc"), ("LORASWAP_COMPILE", "maybe")):
        result = _run("serve", env={variable: text})
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"loraswap serve: {variable}={text!r} is not valid"), result.stderr[-2000:]


def test_serve_with_an_unknown_preload_exits_2_with_one_line() -> None:
    result = _run(
        "serve", "--host", "127.0.0.1", "--port", "0", "--no-compile", "--preload", "outline,no-such-adapter",
        "--log-level", "ERROR", timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "serving" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("loraswap serve: --preload 'no-such-adapter': no adapter named"), result.stderr[-2000:]
