"""ErrorInfo reasons are a closed vocabulary: the engine's ErrorReason and the contract's enum agree exactly.

The rule the contract states: the reason on the wire is the loraswap.v1.ErrorReason
value name without its ERROR_REASON_ prefix.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from loraswap.server import access
from loraswap.server.engine import errors as engine_errors
from loraswap.server.engine.errors import EngineError, ErrorReason
from loraswap.server.transport.errors import STATUS_FOR_ERROR
from loraswap.v1 import diffusion_service_pb2 as pb

PREFIX = "ERROR_REASON_"
UNSPECIFIED = "ERROR_REASON_UNSPECIFIED"
SERVER_SRC = Path(__file__).resolve().parents[2] / "server" / "src" / "loraswap" / "server"
CONTRACT_NAMES = [value.name for value in pb.ErrorReason.DESCRIPTOR.values]
# Every error class callers can get: the engine's, and the access errors of --auth-token-file.
ENGINE_ERRORS = [
    cls
    for module in (engine_errors, access)
    for _, cls in inspect.getmembers(module, inspect.isclass)
    if issubclass(cls, EngineError) and cls.__module__ == module.__name__
]


def test_every_engine_reason_is_in_the_contract() -> None:
    missing = sorted(reason.value for reason in ErrorReason if PREFIX + reason.value not in CONTRACT_NAMES)
    assert not missing, f"add ERROR_REASON_<name> values to ErrorReason in diffusion_service.proto for {missing}"


def test_every_contract_reason_is_an_engine_reason() -> None:
    engine_names = {reason.value for reason in ErrorReason}
    extra = sorted(name for name in CONTRACT_NAMES if name != UNSPECIFIED and name[len(PREFIX) :] not in engine_names)
    assert not extra, f"the contract lists reasons the server never sends: {extra}"


def test_contract_values_follow_the_naming_rule() -> None:
    assert pb.ErrorReason.Value(UNSPECIFIED) == 0
    assert all(name.startswith(PREFIX) for name in CONTRACT_NAMES)
    assert len(CONTRACT_NAMES) == len(ErrorReason) + 1


@pytest.mark.parametrize("reason", list(ErrorReason), ids=lambda reason: reason.value)
def test_engine_reason_is_its_own_wire_string(reason: ErrorReason) -> None:
    assert reason.value == reason.name
    assert str(reason) == f"{reason}" == reason.name
    assert re.fullmatch(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*", reason.value)


@pytest.mark.parametrize("error_class", ENGINE_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_class_has_a_reason_from_the_vocabulary(error_class: type[EngineError]) -> None:
    assert isinstance(error_class.reason, ErrorReason)
    assert isinstance(error_class("x").reason, ErrorReason)


def test_transport_table_maps_every_engine_error_class() -> None:
    """The base class falls back to INTERNAL; every concrete class has its own row."""
    assert set(STATUS_FOR_ERROR) == set(ENGINE_ERRORS) - {EngineError}


def test_a_reason_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="NOT_A_REASON"):
        engine_errors.AdapterFormatError("x", reason="NOT_A_REASON")
    assert engine_errors.AdapterFormatError("x", reason="ADAPTER_PICKLE_REFUSED").reason is (
        ErrorReason.ADAPTER_PICKLE_REFUSED
    )


def test_server_code_names_reasons_by_constant_only() -> None:
    sources = sorted(SERVER_SRC.rglob("*.py"))
    assert sources, f"no server sources under {SERVER_SRC}"
    literal = re.compile(r"""\breason\s*=\s*["']""")
    offenders = [
        f"{path.relative_to(SERVER_SRC)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if literal.search(line)
    ]
    assert not offenders, "use ErrorReason constants, not string literals:\n" + "\n".join(offenders)
