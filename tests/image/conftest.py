"""The figures the image tests measure: shown at the end of the run and written to out/container-image.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIGURES_PATH = Path(__file__).resolve().parents[2] / "out" / "container-image.json"
_FIGURES = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def image_figures(request) -> dict:
    """A dict the tests fill with what they measured (seconds, bytes, exit codes)."""
    return request.config.stash.setdefault(_FIGURES, {})


def pytest_terminal_summary(terminalreporter, config) -> None:
    figures = config.stash.get(_FIGURES, None)
    if not figures:
        return
    FIGURES_PATH.parent.mkdir(exist_ok=True)
    FIGURES_PATH.write_text(json.dumps(figures, indent=2) + "\n")
    terminalreporter.write_sep("-", "container image")
    for name, value in figures.items():
        terminalreporter.write_line(f"{name}: {value}")
    terminalreporter.write_line(f"(also in {FIGURES_PATH})")
