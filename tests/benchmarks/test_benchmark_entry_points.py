"""Every benchmark runs one way, `python -m benchmarks.NAME` from the repository root, and the docs show only that.

A benchmark is a module of benchmarks/ with an `if __name__ == "__main__":` block; the others (processes.py,
__init__.py) are helpers that benchmarks import. The scripts are found from the folder, so a new one is covered
without touching this file. Their `--help` runs in subprocesses started all at once: each takes a fraction of a
second because torch and diffusers are imported inside the functions that need them, which a test checks.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# Where a benchmark's invocation is written down for people to copy.
DOCS = (ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(BENCHMARKS.glob("*.py")), BENCHMARKS / "gpu_check.sh")
# A script run by its path (`python benchmarks/swap.py`, `python3 ./benchmarks/swap.py`) or a path given flags
# (`benchmarks/scaleout.py --balance-factor`); a bare file name (`see benchmarks/startup.py`) is a reference.
OTHER_SPELLING = re.compile(r"python[0-9.]*\s+\S*benchmarks/\w+\.py|benchmarks/\w+\.py\s+-")
MODULE_SPELLING = re.compile(r"python[0-9.]* -m benchmarks\.(\w+)")
HEAVY = {"torch", "diffusers", "transformers", "peft"}


def _is_script(path: Path) -> bool:
    """True for a module with a top-level `if __name__ == "__main__":` block."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            left, right = node.test.left, node.test.comparators[0]
            if isinstance(left, ast.Name) and left.id == "__name__" and getattr(right, "value", None) == "__main__":
                return True
    return False


SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py") if _is_script(path))


def test_the_folder_holds_the_known_benchmarks_and_not_the_helpers() -> None:
    # The rule finds scripts at all (a broken rule would find none and every test below would pass vacuously).
    assert {"swap", "serve", "soak", "scaleout", "lora_tax", "startup", "gpu_check"} <= set(SCRIPTS)
    assert "processes" not in SCRIPTS and "__init__" not in SCRIPTS


def _start_help(name: str) -> subprocess.Popen:
    # -X importtime lists every module imported on stderr, one a line, ending with its name.
    command = [sys.executable, "-X", "importtime", "-m", f"benchmarks.{name}", "--help"]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def help_runs() -> dict[str, subprocess.CompletedProcess]:
    """`python -m benchmarks.NAME --help` from the repository root for every script, run side by side."""
    started = {name: _start_help(name) for name in SCRIPTS}
    runs = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        runs[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return runs


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_runs_as_a_module_and_names_that_spelling(name, help_runs) -> None:
    run = help_runs[name]
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith(f"usage: python -m benchmarks.{name} "), run.stdout[:200]
    # What keeps --help (and this test) fast: the heavy packages load only when a benchmark runs.
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & HEAVY, f"benchmarks.{name} imports {sorted(imported & HEAVY)} at module level"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_docs_show_only_the_module_spelling_of_existing_benchmarks(doc) -> None:
    text = doc.read_text()
    assert OTHER_SPELLING.findall(text) == [], f"run benchmarks as `python -m benchmarks.NAME` in {doc.name}"
    assert set(MODULE_SPELLING.findall(text)) <= set(SCRIPTS)
