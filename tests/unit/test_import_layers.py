"""Imports only go down: the server never imports the client, and each engine module imports only its own layer
and the layers below it.

Every import counts, at the top of a module or inside a function: a deferred import is a dependency all the same
(engine/config.py once imported pipeline/quantization.py inside `__post_init__`, which imported engine/config.py
back). The sources are read with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER_SRC = Path(__file__).resolve().parents[2] / "server" / "src"
SERVER = "loraswap.server"
ENGINE = "loraswap.server.engine"
CLIENT = "loraswap.client"
# `loraswap demo` is a client of the server it starts: the one server module that may use the client.
CLIENTS_OF_THE_SERVER = {"loraswap.server.demo"}

# The engine's layers, lowest first. A module may import from its own layer and the layers before it; a name
# is a module below engine/ or a subpackage of it (every module inside).
ENGINE_LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer)
    for layer in (
        # Plain values and vocabularies: option lists and limits, domain types, errors, the engine's seams.
        ("errors", "types", "observer", "interface", "families", "compile_options", "quantize_options",
         "scale_limits", "fuse_policy", "rank_buckets", "quiet_imports"),
        ("adapters",),  # reading, converting, caching and swapping adapters
        ("models",),  # the built-in models and model loading (which name bases as adapters/base_model.py does)
        ("config",),  # EngineConfig: the settings and the checks their values alone decide
        ("request_rules",),  # what a request may ask of the resident model
        ("pipeline",),  # the resident pipeline: pre-flight, start-up, runtime, warm-up
        ("scheduler",),  # the worker thread and its queue
        ("diffusion_engine",),  # the engine the transport talks to
    )
)  # fmt: skip
# What no engine module imports: the wire (STYLE.md: the engine never sees a proto).
ENGINE_NEVER_IMPORTS = ("grpc", "loraswap.v1", "loraswap.wire", CLIENT)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SERVER_SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, anywhere in it, by absolute name.

    `from a.b import c` gives both a.b and a.b.c, as c may be a module; relative imports are resolved.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def engine_layer(name: str) -> int | None:
    """The index in ENGINE_LAYERS of an engine module; None for the engine package itself (it holds nothing)."""
    relative = name.removeprefix(ENGINE + ".") if name != ENGINE else ""
    if not relative:
        return None
    top = relative.split(".")[0]
    for index, layer in enumerate(ENGINE_LAYERS):
        if top in layer:
            return index
    raise LookupError(f"{ENGINE}.{top} has no layer: add it to ENGINE_LAYERS in {Path(__file__).name}")


def client_imports(source: str, module: str) -> list[str]:
    """The loraswap.client modules a server module imports."""
    return sorted(name for name in imported_modules(source, module) if _within(name, CLIENT))


def engine_climbs(source: str, module: str, is_package: bool = False) -> list[str]:
    """What an engine module imports that is above its layer, outside the engine in the server, or the wire."""
    own = engine_layer(module)
    problems = []
    for name in sorted(imported_modules(source, module, is_package)):
        if any(_within(name, banned) for banned in ENGINE_NEVER_IMPORTS):
            problems.append(f"{name} (the engine never imports the wire)")
        elif _within(name, ENGINE):
            layer = engine_layer(name)
            if own is not None and layer is not None and layer > own:
                problems.append(f"{name} (layer {layer}, above this module's {own})")
        elif _within(name, SERVER) and name != SERVER:
            problems.append(f"{name} (the engine imports nothing of the server around it)")
    return problems


def settings_imports(source: str) -> list[str]:
    """What the settings (loraswap.server.config) import of the server beyond the engine: nothing may be."""
    return sorted(
        name for name in imported_modules(source, f"{SERVER}.config")
        if _within(name, SERVER) and name != SERVER and not _within(name, ENGINE)
    )  # fmt: skip


def _sources(package: str) -> list[Path]:
    root = SERVER_SRC.joinpath(*package.split("."))
    paths = sorted(root.rglob("*.py"))
    assert paths, f"no modules under {root}"
    return paths


def _id(path: Path) -> str:
    return str(path.relative_to(SERVER_SRC))


@pytest.mark.parametrize(
    "path", [path for path in _sources(SERVER) if _module_name(path) not in CLIENTS_OF_THE_SERVER], ids=_id
)
def test_no_server_module_imports_the_client(path: Path) -> None:
    module = _module_name(path)
    # The wire's facts (metadata key, keepalive, service config) are loraswap.wire's, beside the stubs.
    assert client_imports(path.read_text(), module) == [], f"{module} imports the client"


@pytest.mark.parametrize("path", _sources(ENGINE), ids=_id)
def test_engine_modules_import_only_their_layer_and_below(path: Path) -> None:
    module = _module_name(path)
    climbs = engine_climbs(path.read_text(), module, is_package=path.name == "__init__.py")
    assert climbs == [], f"{module} imports {climbs}"


def test_the_settings_import_nothing_that_watches_or_serves_them() -> None:
    # Settings are the lower layer: observability and the transport take them, never the other way.
    assert settings_imports((SERVER_SRC / "loraswap" / "server" / "config.py").read_text()) == []


# The imports that made the circles and climbs this file guards against, as they once were written.
@pytest.mark.parametrize(
    ("module", "source"),
    [
        (f"{ENGINE}.config",
         "def __post_init__(self):\n    from loraswap.server.engine.pipeline.quantization import check_quantization\n"),
        (f"{ENGINE}.config",
         "def __post_init__(self):\n    from loraswap.server.engine.pipeline.attention import check_attention\n"),
        (f"{ENGINE}.adapters.canonical", "from loraswap.server.engine.request_rules import MAX_ADAPTER_SCALE\n"),
        (f"{ENGINE}.adapters.canonical", "from ..request_rules import MAX_ADAPTER_SCALE\n"),
        (f"{ENGINE}.models.registry", "from loraswap.server.engine import config\n"),
        (f"{ENGINE}.scheduler", "from loraswap.server.transport.convert import job_from_pb\n"),
        (f"{ENGINE}.types", "from loraswap.v1 import diffusion_service_pb2 as pb\n"),
    ],
)  # fmt: skip
def test_an_engine_import_that_climbs_is_caught(module: str, source: str) -> None:
    assert engine_climbs(source, module) != []


@pytest.mark.parametrize(
    "source",
    [
        "from loraswap.client.connection import LORA_METADATA_KEY\n",
        "from loraswap.client.events import is_repeated\n",
        "def serve():\n    import loraswap.client.connection\n",
        "from loraswap import client\n",
    ],
)
def test_a_server_import_of_the_client_is_caught(source: str) -> None:
    assert client_imports(source, f"{SERVER}.app") != []


def test_a_settings_import_of_observability_is_caught() -> None:
    assert settings_imports("from loraswap.server.observability.log_format import LOG_FORMATS\n") != []


def test_a_new_engine_module_must_be_given_a_layer() -> None:
    with pytest.raises(LookupError, match="ENGINE_LAYERS"):
        engine_layer(f"{ENGINE}.somewhere_new")
