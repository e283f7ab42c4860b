"""The LoraConfig an adapter file carries, checked as untrusted input, and the per-layer scalings it gives.

diffusers hands the LoraConfig stored in a file's metadata to PEFT; only the fields that decide what a loaded
adapter computes get there, each checked first. The scalings are alpha/rank exactly as diffusers'
load_lora_adapter configures PEFT.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, ErrorReason, shorten

if TYPE_CHECKING:
    import torch

# Honest LoraConfig JSON has at most one pattern per layer.
MAX_PATTERN_ENTRIES = 1024
MAX_PATTERN_CHARS = 256
# PEFT runs rank_pattern/alpha_pattern keys as regular expressions; only literal module names (where '.' is the
# one metacharacter, and it cannot backtrack) are let through, so no file can make matching take unbounded time.
_LITERAL_PATTERN = re.compile(r"\^?[A-Za-z0-9_.]+")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked_patterns(name: str, patterns: object, value_ok: Callable[[object], bool], reason: ErrorReason) -> None:
    """Refuse a pattern dict PEFT would run unbounded or choke on: too many keys, a non-literal key, a bad value."""
    if not isinstance(patterns, dict):
        raise AdapterFormatError(
            f"the adapter's {name} is a {type(patterns).__name__}; it must map module names to values",
            reason=reason,
        )
    if len(patterns) > MAX_PATTERN_ENTRIES:
        raise AdapterFormatError(
            f"the adapter's {name} has {len(patterns)} entries; at most {MAX_PATTERN_ENTRIES} are accepted",
            reason=reason,
        )
    for key, value in patterns.items():
        if len(key) > MAX_PATTERN_CHARS or not _LITERAL_PATTERN.fullmatch(key):
            raise AdapterFormatError(
                f"the adapter's {name} has the key {shorten(key, 80)!r}; keys must be module names (letters, digits, "
                f"'_' and '.', at most {MAX_PATTERN_CHARS} characters), never regular expressions",
                reason=reason,
            )
        if not value_ok(value):
            raise AdapterFormatError(
                f"the adapter's {name} gives {shorten(key, 80)!r} the value {shorten(value, 40)!r}; "
                "use a number (a positive integer for ranks)",
                reason=reason,
            )


# The LoraConfig fields that decide what a loaded adapter computes, with what each must be. The rest (dropout,
# init options, training settings, ...) never reach PEFT, so nothing in them can fail or run there.
_LORA_CONFIG_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    "lora_alpha": (_is_number, "a number"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "use_dora": (lambda v: isinstance(v, bool), "true or false"),
}


def _lora_config_fields(metadata: dict) -> dict:
    """The fields of a LoraConfig from file metadata that matter here, each checked, before PEFT sees any."""
    fields = {}
    for key, (is_valid, expected) in _LORA_CONFIG_FIELDS.items():
        if key in metadata and metadata[key] is not None:
            if not is_valid(metadata[key]):
                raise AdapterFormatError(
                    f"the adapter's LoRA setting {key} is {shorten(metadata[key], 40)!r}; it must be {expected}",
                    reason=ErrorReason.ADAPTER_BAD_METADATA,
                )
            fields[key] = metadata[key]
    for key, value_ok in (
        ("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        ("alpha_pattern", _is_number),
    ):
        if metadata.get(key) is not None:
            _checked_patterns(key, metadata[key], value_ok, ErrorReason.ADAPTER_BAD_METADATA)
            fields[key] = metadata[key]
    return fields


def _pattern_lookup(patterns: Mapping[str, object]) -> Callable[[str], str | None]:
    """PEFT's get_pattern_key (the first key whose pattern ends the module name) with each pattern compiled once.

    get_pattern_key compiles per call, and past re's cache of 512 patterns that is a compile per module and key.
    """
    compiled = [(key, re.compile(rf"(.*\.)?({key})$")) for key in patterns]

    def lookup(module: str) -> str | None:
        return next((key for key, pattern in compiled if pattern.match(module)), None)

    return lookup


def layer_scalings(
    state_dict: dict[str, torch.Tensor],
    alphas: dict[str, float] | None,
    metadata: dict | None,
    prefix: str,
    *,
    dora: bool = False,
) -> dict[str, float]:
    """Per-module alpha/rank exactly as diffusers' load_lora_adapter configures PEFT; `dora`: a DoRA config is
    accepted (the server fuses), else refused."""
    from diffusers.utils.peft_utils import _create_lora_config

    ranks = {f"^{key}": value.shape[1] for key, value in state_dict.items() if "lora_B" in key and value.ndim > 1}
    if alphas:
        alphas = {k.removeprefix(f"{prefix}."): v for k, v in alphas.items() if k.startswith(f"{prefix}.")}
    if metadata:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
        metadata = _lora_config_fields(metadata) if metadata else None
    try:
        config = _create_lora_config(state_dict, alphas or None, metadata, ranks)
    # Checked fields only reach PEFT; anything it still refuses is an invalid configuration, not a server fault.
    except Exception as exc:
        raise AdapterFormatError(f"the adapter's LoRA configuration is not valid ({shorten(exc)})") from exc
    if getattr(config, "use_dora", False) and not dora:
        raise AdapterIncompatibleError("DoRA adapters cannot be swapped in place; use a plain LoRA")
    # Without metadata, diffusers derives alpha_pattern keys from the file's alpha tensor names: check those too.
    _checked_patterns(
        "alpha_pattern", config.alpha_pattern, _is_number,
        ErrorReason.ADAPTER_BAD_METADATA if metadata is not None else ErrorReason.ADAPTER_MALFORMED,
    )  # fmt: skip
    alpha_key_of = _pattern_lookup(config.alpha_pattern)
    scalings = {}
    for key, value in state_dict.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        rank = value.shape[0]
        alpha = config.alpha_pattern.get(alpha_key_of(module), config.lora_alpha)
        if not math.isfinite(alpha):
            raise AdapterFormatError(
                f"layer {shorten(module)} has LoRA alpha {alpha}; alpha must be a finite number",
                reason=ErrorReason.ADAPTER_NOT_FINITE,
            )
        scalings[module] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    return scalings
