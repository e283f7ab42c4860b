"""`loraswap serve --help` shows every flag's default and choices; a bad LORASWAP_* value is one line naming it.

The parser is built for every `loraswap` command (the server registers `serve` beside the client's commands),
so a bad variable must not break building it: `serve` refuses it when it turns the flags into Settings.
"""

from __future__ import annotations

import argparse

import pytest

from loraswap.server.config import LOG_LEVELS, SettingsError, add_serve_arguments, settings_from_args
from loraswap.server.engine.config import COMPILE_BACKENDS


def _parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ=environ)
    return parser


def _actions(environ: dict[str, str] | None = None) -> dict[str, argparse.Action]:
    return {action.option_strings[0]: action for action in _parser(environ or {})._actions if action.dest != "help"}


def test_every_flag_help_shows_its_default() -> None:
    for flag, action in _actions().items():
        if flag == "--no-compile":  # an alias of --compile none, whose help shows the default
            assert "--compile none" in action.help
            continue
        assert "default: " in action.help, flag


@pytest.mark.parametrize(
    ("flag", "default_text"),
    [("--port", "(default: 50051)"), ("--max-rank", "(default: 64)"), ("--allow-hub", "(default: off)"),
     ("--preload", "(default: none)"), ("--pin", "(default: none)"), ("--layers", "(default: all)"),
     ("--compile-backend", "(default: inductor)"), ("--log-level", "(default: INFO)")],
)  # fmt: skip
def test_help_states_the_default(flag: str, default_text: str) -> None:
    assert default_text in _actions()[flag].help


def test_help_says_when_the_default_comes_from_the_environment() -> None:
    assert "(default: 7000, from LORASWAP_PORT)" in _actions({"LORASWAP_PORT": "7000"})["--port"].help


def test_rendered_help_lists_defaults_and_choices() -> None:
    text = _parser({}).format_help()
    assert "{float32,float16,bfloat16}" in text and "{" + ",".join(COMPILE_BACKENDS) + "}" in text
    assert "{" + ",".join(LOG_LEVELS) + "}" in text


@pytest.mark.parametrize(
    ("flag", "choices"),
    [("--dtype", ("float32", "float16", "bfloat16")), ("--compile-backend", COMPILE_BACKENDS),
     ("--log-level", LOG_LEVELS)],
)  # fmt: skip
def test_choices(flag: str, choices: tuple[str, ...]) -> None:
    assert tuple(_actions()[flag].choices) == choices
    with pytest.raises(SystemExit):
        _parser({}).parse_args([flag, "nonsense"])


def test_compile_backends_are_torch_compile_backends() -> None:
    import torch._dynamo

    assert set(COMPILE_BACKENDS) <= set(torch._dynamo.list_backends(exclude_tags=()))


def test_log_level_is_taken_in_any_case() -> None:
    parser = _parser({"LORASWAP_LOG_LEVEL": "debug"})
    assert settings_from_args(parser.parse_args([])).log_level == "DEBUG"
    assert settings_from_args(parser.parse_args(["--log-level", "warning"])).log_level == "WARNING"


@pytest.mark.parametrize(
    ("variable", "text", "expected"),
    [("LORASWAP_PORT", "abc", "an integer"), ("LORASWAP_MAX_RANK", "6.5", "an integer"),
     ("LORASWAP_GRACE_SECONDS", "soon", "a number"), ("LORASWAP_COMPILE", "maybe", "none, full, regional"),
     ("LORASWAP_ALLOW_HUB", "", "true or false"), ("LORASWAP_DTYPE", "fp7", "float32, float16, bfloat16"),
     ("LORASWAP_COMPILE_BACKEND", "turbo", "inductor"), ("LORASWAP_LOG_LEVEL", "loud", "DEBUG, INFO")],
)  # fmt: skip
def test_bad_environment_value_is_one_line_naming_the_variable(variable: str, text: str, expected: str) -> None:
    parser = _parser({variable: text})  # building the parser does not fail: other commands still work
    with pytest.raises(SettingsError) as refused:
        settings_from_args(parser.parse_args([]))
    message = str(refused.value)
    assert message.startswith(f"{variable}={text!r} is not valid") and expected in message and "\n" not in message


def test_a_flag_given_wins_over_a_bad_variable() -> None:
    parser = _parser({"LORASWAP_PORT": "abc", "LORASWAP_DTYPE": "fp7"})
    settings = settings_from_args(parser.parse_args(["--port", "7", "--dtype", "float16"]))
    assert (settings.port, settings.engine.dtype) == (7, "float16")
