"""Session fixtures: real tiny pipelines, real PEFT-written adapters, plain-diffusers references.

Nothing heavy is imported at module level, so that the client's tests (tests/client)
run where only the client distribution is installed. Helpers live in tests/support.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config) -> None:
    """One torch thread per test process where the server is installed (CI has two cores)."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        from tests.support.servers import TEST_TORCH_THREADS

        torch.set_num_threads(TEST_TORCH_THREADS)


@pytest.fixture(scope="session")
def flux_adapter_dir(tmp_path_factory) -> Path:
    from tests.support.adapters import FLUX_ADAPTERS, write_adapters

    return write_adapters("tiny-flux", tmp_path_factory.mktemp("flux-adapters"), FLUX_ADAPTERS, init_std=0.5)


@pytest.fixture(scope="session")
def sdxl_adapter_dir(tmp_path_factory) -> Path:
    from tests.support.adapters import SDXL_ADAPTERS, write_adapters

    return write_adapters("tiny-sdxl", tmp_path_factory.mktemp("sdxl-adapters"), SDXL_ADAPTERS, init_std=0.2)


@pytest.fixture(scope="session")
def exported_models(tmp_path_factory) -> dict[str, Path]:
    """The built-in models as plain diffusers folders, for references made with diffusers alone."""
    from loraswap.server.engine.models import builtin_model

    root = tmp_path_factory.mktemp("models")
    return {name: builtin_model(name).export(root / name) for name in ("tiny-flux", "tiny-sdxl")}


@pytest.fixture(scope="session")
def flux_reference(exported_models, flux_adapter_dir):
    from tests.support.reference import DiffusersReference

    return DiffusersReference(exported_models["tiny-flux"], "flux", flux_adapter_dir)


@pytest.fixture(scope="session")
def sdxl_reference(exported_models, sdxl_adapter_dir):
    from tests.support.reference import DiffusersReference

    return DiffusersReference(exported_models["tiny-sdxl"], "sdxl", sdxl_adapter_dir)
