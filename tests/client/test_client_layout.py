"""The client distribution stands alone: nothing under client/ imports the server or anything heavy.

A microservice installs loraswap-client to call a server; it must not pull (or
import) torch, diffusers, transformers, numpy or pillow, and it must not reach
into loraswap.server. These checks need only the client installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from loraswap.client import command

CLIENT_SRC = Path(__file__).resolve().parents[2] / "client" / "src"
HEAVY = ("torch", "diffusers", "transformers", "peft", "numpy", "PIL", "safetensors", "accelerate")
FORBIDDEN = ("loraswap.server", *HEAVY)


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def _client_sources() -> list[Path]:
    sources = [p for p in CLIENT_SRC.rglob("*.py") if "v1" not in p.relative_to(CLIENT_SRC).parts[1:2]]
    assert sources, f"no client sources under {CLIENT_SRC}"
    return sources


@pytest.mark.parametrize("path", _client_sources(), ids=lambda p: str(p.relative_to(CLIENT_SRC)))
def test_no_client_module_imports_the_server_or_heavy_packages(path: Path) -> None:
    offending = {
        module for module in _imported_modules(path) for banned in FORBIDDEN
        if module == banned or module.startswith(banned + ".")
    }  # fmt: skip
    assert not offending, f"{path} imports {sorted(offending)}"


def test_importing_the_client_and_its_command_loads_nothing_heavy() -> None:
    probe = (
        "import sys, loraswap.client, loraswap.client.command; "
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"importing loraswap.client loaded {loaded}"


def test_missing_server_commands_say_what_to_install(capsys, monkeypatch) -> None:
    # As if only the client were installed: no distribution registers the server's commands.
    monkeypatch.setattr(command, "entry_points", lambda group: [])
    for name in command.SERVER_COMMANDS:
        assert command.main([name, "--model", "shapes"]) == command.EXIT_USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and command.SERVER_DISTRIBUTION in err[0] and name in err[0], err


def test_client_commands_are_always_there(monkeypatch) -> None:
    monkeypatch.setattr(command, "entry_points", lambda group: [])
    choices = command.build_parser()._subparsers._group_actions[0].choices
    assert {"generate", "preload", "evict", "adapters", "info"} <= set(choices)
