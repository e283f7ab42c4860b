"""How a setting is declared: a dataclass field made by `setting(...)`, its `SettingSpec`, and the readers that turn
the text of a flag or an environment variable into its value.

A front end derives its argument parser and its environment reading from these fields and nothing else
(loraswap.server.config); EngineConfig (config.py) and the server's Settings are declared with them. A value
the server cannot start with is a SettingsError, whose one-line message says what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path

_SPEC_KEY = "loraswap_setting"


class SettingsError(ValueError):
    """Settings the server cannot start with (a value out of range, an incomplete combination, an unusable file).

    The message is one line that says what to change; `loraswap serve` prints it and exits 2.
    """


@dataclass(frozen=True)
class SettingSpec:
    """How one setting is given: as a flag `--name-with-dashes` and as the variable LORASWAP_NAME."""

    help: str
    # The text of the flag or variable -> the value (argparse's `type`; it may raise ValueError/ArgumentTypeError).
    parse: Callable[[str], object] = str
    choices: tuple | None = None
    metavar: str | None = None
    switch: bool = False  # on/off: --name / --no-name, and true/false (1/0, yes/no, on/off) in the variable
    const: object = None  # the value of the flag given alone (a flag that takes an optional value)
    # A flag --no-name that sets this value (for a flag that is not a switch), with its help line.
    negated: tuple[object, str] | None = None
    # A flag given once per value (`parse` reads one), the values a tuple; its variable holds them comma-separated.
    repeatable: bool = False


def setting(default: object, help: str, **spec: object) -> Field:
    """A dataclass field that is a setting: its default, help line, and the rest of its SettingSpec."""
    return field(default=default, metadata={_SPEC_KEY: SettingSpec(help=help, **spec)})


def setting_fields(config_class: type) -> list[tuple[Field, SettingSpec]]:
    """The fields of a settings dataclass that are settings, in declaration order, each with its spec."""
    return [(item, item.metadata[_SPEC_KEY]) for item in fields(config_class) if _SPEC_KEY in item.metadata]


def check_setting(check: Callable[..., object], *args: object) -> None:
    """Run a check that raises ValueError with a one-line message, as a SettingsError."""
    try:
        check(*args)
    except SettingsError:
        raise
    except ValueError as error:
        raise SettingsError(str(error)) from None


# -- how text becomes a value (flags and variables alike) -------------------------------------------------


def optional_text(text: str) -> str | None:
    """An empty flag or variable means "not set", as an absent one does."""
    return text or None


def optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def names(text: str) -> tuple[str, ...]:
    """`a, b,,c` -> ("a", "b", "c")."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def optional_names(text: str) -> tuple[str, ...] | None:
    """Like `names`, but nothing named means the default (None)."""
    return names(text) or None


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive number of seconds")
    return value
