"""The client alone, at its declared floor versions, in a fresh virtual environment, against a real server.

`pip install ./client` with exactly the floors client/pyproject.toml declares for grpcio,
protobuf, googleapis-common-protos and tqdm must give a working client: the generated stubs
import (they refuse an older grpcio or protobuf than the tools that made them), nothing
heavy is installed, `loraswap generate -o out.png` writes the served image, `loraswap
serve` names the package to install, and the client's own tests pass there.

It downloads the floor wheels from the package index: where none can be reached it
skips, except in CI, where it must run.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
import tomllib
import venv
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support.images import decode
from tests.support.servers import address_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"
FLOORED = ("grpcio", "protobuf", "googleapis-common-protos", "tqdm")
HEAVY = ("torch", "diffusers", "transformers", "numpy", "pillow", "peft", "safetensors")
# Test tools for tests/client inside the client-only environment (grpcio-status at the grpcio floor).
CLIENT_TEST_TOOLS = ("pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3")


def declared_floors() -> dict[str, str]:
    """name -> version for each `name>=version` in client/pyproject.toml's dependencies."""
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    floors = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", requirement.replace(" ", ""))
        assert match, f"client dependency {requirement!r} is not written as name>=floor"
        floors[match.group(1).lower()] = match.group(2)
    assert set(floors) == set(FLOORED), f"client dependencies are {sorted(floors)}; expected exactly {FLOORED}"
    return floors


def _pip(python: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def client_env(tmp_path_factory) -> dict:
    """A fresh venv holding loraswap-client at its floors (plus pytest for tests/client), and what that cost."""
    floors = declared_floors()
    env_dir = tmp_path_factory.mktemp("client-only") / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pins = [f"{name}=={version}" for name, version in floors.items()]
    started = time.perf_counter()
    installed = _pip(python, "install", "-q", str(CLIENT), *pins)
    install_s = time.perf_counter() - started
    if installed.returncode != 0:
        unreachable = "No matching distribution" in installed.stderr or "connection" in installed.stderr.lower()
        if unreachable and not os.environ.get("CI"):
            pytest.skip(f"the package index cannot be reached to fetch the floor versions: {installed.stderr[-300:]}")
        pytest.fail(f"pip install ./client {' '.join(pins)} failed:\n{installed.stderr[-3000:]}")
    listing = _pip(python, "list", "--format=freeze").stdout
    versions = dict(line.lower().split("==", 1) for line in listing.splitlines() if "==" in line)
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    tools = _pip(python, "install", "-q", *CLIENT_TEST_TOOLS, f"grpcio-status=={floors['grpcio']}", *pins)
    assert tools.returncode == 0, tools.stderr[-3000:]
    print(f"client-only install: {install_s:.1f} s, site-packages {size / 2**20:.1f} MiB, {len(versions)} distributions")
    return {"bin": env_dir / "bin", "python": python, "versions": versions, "floors": floors}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def shapes_server():
    async with serving("shapes", None, compile=False) as running:
        yield running


def test_the_floor_versions_are_what_got_installed(client_env) -> None:
    for name, version in client_env["floors"].items():
        assert client_env["versions"].get(name) == version, (name, client_env["versions"].get(name))


def test_nothing_heavy_is_installed(client_env) -> None:
    heavy = sorted(name for name in HEAVY if name in client_env["versions"])
    assert not heavy, f"installing the client pulled {heavy}"
    assert "loraswap-server" not in client_env["versions"]


async def test_generate_writes_the_served_image(client_env, shapes_server, tmp_path) -> None:
    out = tmp_path / "out.png"
    process = await asyncio.create_subprocess_exec(
        str(client_env["bin"] / "loraswap"), "generate", "a red circle on a blue background",
        "--adapter", "outline", "--seed", "7", "--server", address_of(shapes_server), "-o", str(out), "-q",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=300)
    assert process.returncode == 0, stderr.decode()
    assert decode(out.read_bytes()).shape == (64, 64, 3)


def test_serve_says_which_package_to_install(client_env) -> None:
    result = subprocess.run([str(client_env["bin"] / "loraswap"), "serve"], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "loraswap-server" in lines[0], result.stderr


def test_the_client_tests_pass_without_the_server(client_env) -> None:
    result = subprocess.run(
        [str(client_env["python"]), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/client"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", result.stdout), result.stdout[-2000:]
