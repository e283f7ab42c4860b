"""The Engine protocol the transport is typed against: DiffusionEngine and the test double both keep to it."""

from __future__ import annotations

import inspect

import pytest

from loraswap.server.engine.diffusion_engine import DiffusionEngine
from loraswap.server.engine.interface import Engine
from tests.support.engines import ScriptedEngine, one_step

MEMBERS = [name for name, _ in inspect.getmembers(Engine, inspect.isfunction) if not name.startswith("_")]


def _shape(function) -> tuple[list[tuple[str, object, object]], bool, bool]:
    """Parameters (name, kind, default) besides self, and whether it is a coroutine / an async generator."""
    parameters = [
        (parameter.name, parameter.kind, parameter.default)
        for parameter in inspect.signature(function).parameters.values()
        if parameter.name != "self"
    ]
    return parameters, inspect.iscoroutinefunction(function), inspect.isasyncgenfunction(function)


def test_the_protocol_names_what_the_transport_calls() -> None:
    assert set(MEMBERS) == {
        "start", "stop_accepting", "drain", "abort_all", "stop", "generate", "preload", "evict", "list_adapters",
        "describe", "gauges", "reload_url_tokens",
    }  # fmt: skip


@pytest.mark.parametrize("implementation", [DiffusionEngine, ScriptedEngine], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("member", MEMBERS)
def test_implementations_keep_the_protocol_signatures(implementation: type, member: str) -> None:
    declared_parameters, declared_coroutine, _ = _shape(getattr(Engine, member))
    parameters, coroutine, async_generator = _shape(getattr(implementation, member))
    assert [name for name, *_ in parameters] == [name for name, *_ in declared_parameters]
    assert [(kind, default) for _, kind, default in parameters] == [
        (kind, default) for _, kind, default in declared_parameters
    ]
    # generate is declared as returning an async iterator: an async generator function is one.
    assert coroutine == declared_coroutine or (member == "generate" and async_generator)


def test_the_double_is_an_engine() -> None:
    assert isinstance(ScriptedEngine(one_step), Engine)
