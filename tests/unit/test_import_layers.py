"""Imports only go down: the server never imports the client, each engine module imports only its own layer
and the layers below it, the adapter rooms import sources -> formats -> residency only, and the server's import
picture (tests/support/import_graph.py, as the README draws it) has no circle.

Every import counts, at the top of a module or inside a function: a deferred import is a dependency all the same
(engine/config.py once imported pipeline/quantization.py inside `__post_init__`, which imported engine/config.py
back). The sources are read with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.import_graph import ImportGraph, imported_modules, module_name

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
        # Plain values and vocabularies: option lists and limits, domain types, errors, the engine's seams, how a
        # setting is declared.
        ("errors", "types", "observer", "interface", "families", "family_traits", "compile_options", "quantize_options",
         "scale_limits", "fuse_policy", "rank_buckets", "quiet_imports", "setting_spec"),
        ("adapters",),  # reading, converting, caching and swapping adapters
        ("models",),  # the built-in models and model loading (which name bases as adapters/sources/base_model.py does)
        ("config",),  # EngineConfig: the settings and the checks their values alone decide
        ("configured_sources", "served_adapters"),  # the sources the config names, the loader threads, the cache
        ("request_rules",),  # what a request may ask of the resident model
        ("pipeline",),  # the resident pipeline: pre-flight, start-up, runtime, warm-up
        ("scheduler",),  # the worker thread and its queue
        ("diffusion_engine",),  # the engine the transport talks to
    )
)  # fmt: skip
# What no engine module imports: the wire (STYLE.md: the engine never sees a proto).
ENGINE_NEVER_IMPORTS = ("grpc", "loraswap.v1", "loraswap.wire", CLIENT)


def _module_name(path: Path) -> str:
    return module_name(path, SERVER_SRC)


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


ADAPTERS = f"{ENGINE}.adapters"
# The adapter rooms, lowest first: a room's modules import their own room's modules and the rooms before it.
ADAPTER_ROOMS = ("sources", "formats", "residency")
# Where the imports of the rooms are checked from: the server, the tests and the benchmarks.
REPO = SERVER_SRC.parents[1]
ROOM_USERS = (SERVER_SRC / "loraswap" / "server", REPO / "tests", REPO / "benchmarks")


def adapter_room(name: str) -> str | None:
    """The room a module of engine/adapters belongs to; None outside the rooms."""
    relative = name.removeprefix(ADAPTERS + ".") if _within(name, ADAPTERS) and name != ADAPTERS else ""
    if not relative:
        return None
    room = relative.split(".")[0]
    if room not in ADAPTER_ROOMS:
        raise LookupError(f"{ADAPTERS}.{room} is in no room: put it in one of {ADAPTER_ROOMS}")
    return room


def room_problems(source: str, module: str, is_package: bool = False) -> list[str]:
    """What a module imports of the adapter rooms that it may not: a room above its own, a module inside another
    room (the others use a room's public names, its package), or its own room's package (a circle through the
    package's names)."""
    own = adapter_room(module)
    problems = []
    for name in sorted(imported_modules(source, module, is_package)):
        room = adapter_room(name)
        if room is None:
            continue
        package = f"{ADAPTERS}.{room}"
        if own is not None and ADAPTER_ROOMS.index(room) > ADAPTER_ROOMS.index(own):
            problems.append(f"{name} (room {room}, above this module's {own})")
        elif room != own and name != package and name.rpartition(".")[0] != package:
            problems.append(f"{name} (inside room {room}: import its public names from {package})")
        elif room != own and name.rpartition(".")[0] == package and name.rpartition(".")[2] not in _public(room):
            problems.append(f"{name} (a module of room {room}: import its public names from {package})")
        elif room == own and name == package and not is_package:
            problems.append(f"{name} (its own room's package: import the module that defines the name)")
    return problems


def _public(room: str) -> frozenset[str]:
    init = SERVER_SRC.joinpath(*ADAPTERS.split("."), room, "__init__.py")
    names = next(
        (node.value for node in ast.walk(ast.parse(init.read_text()))
         if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)),
        None,
    )  # fmt: skip
    return frozenset(ast.literal_eval(names)) if names is not None else frozenset()


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


@pytest.mark.parametrize(
    "path",
    [path for root in ROOM_USERS for path in sorted(root.rglob("*.py"))],
    ids=lambda path: str(path.relative_to(REPO)),
)
def test_the_adapter_rooms_are_imported_downward_and_through_their_public_names(path: Path) -> None:
    inside_server = SERVER_SRC in path.parents
    module = _module_name(path) if inside_server else ".".join(path.relative_to(REPO).with_suffix("").parts)
    problems = room_problems(path.read_text(), module, is_package=path.name == "__init__.py")
    assert problems == [], f"{module} imports {problems}"


def test_every_adapter_module_is_in_a_room() -> None:
    loose = sorted(
        path.name for path in SERVER_SRC.joinpath(*ADAPTERS.split(".")).glob("*.py") if path.name != "__init__.py"
    )
    assert loose == [], f"engine/adapters/ holds modules outside its rooms: {loose}"


def test_the_server_import_picture_has_no_circle_and_no_arrow_back_up() -> None:
    graph = ImportGraph.of(SERVER_SRC / "loraswap" / "server")
    assert len(graph.arrows) > 50
    assert graph.circles() == []
    assert graph.arrows_back_up() == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (f"{ADAPTERS}.sources.safetensors_file", "from loraswap.server.engine.adapters.formats import LayerChange\n"),
        (f"{ADAPTERS}.formats.canonical", "from loraswap.server.engine.adapters.residency.fused import FusedWeights\n"),
        (f"{ADAPTERS}.residency.fused", "from loraswap.server.engine.adapters.formats.canonical import SlotSpec\n"),
        (f"{ADAPTERS}.residency.fused", "from loraswap.server.engine.adapters.residency import HotswapSlot\n"),
        (f"{ENGINE}.diffusion_engine", "from loraswap.server.engine.adapters.sources.url_fetch import UrlTimeouts\n"),
        (f"{ENGINE}.diffusion_engine", "from loraswap.server.engine.adapters.formats import canonical\n"),
        ("tests.unit.test_x", "from loraswap.server.engine.adapters.residency.slot import HotswapSlot\n"),
    ],
)  # fmt: skip
def test_an_import_against_the_rooms_is_caught(module: str, source: str) -> None:
    assert room_problems(source, module) != []


def test_a_circle_is_seen(tmp_path: Path) -> None:
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import A\n")
    (package / "c.py").write_text("from pkg import a\n")
    graph = ImportGraph.of(package)
    assert graph.circles() == [["pkg.a", "pkg.b"]]
    assert graph.arrows["pkg.c"] == {"pkg.a"}
    assert len(graph.arrows_back_up()) == 2
