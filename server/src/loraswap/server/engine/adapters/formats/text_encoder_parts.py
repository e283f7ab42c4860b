"""The text-encoder parts of an adapter file, told by their names alone: the one place that says what names one.

diffusers and PEFT key a text encoder's layers by its pipeline attribute, `text_encoder`, `text_encoder_2`,
`text_encoder_3` (`text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight`); kohya's sd-scripts
prefix them `lora_te` (a pipeline with one text encoder), `lora_te1`, `lora_te2`, `lora_te3`
(`lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight`).

A family whose pipeline diffusers loads no text-encoder LoRA into (FamilyTraits.text_encoders empty: Qwen-Image,
Z-Image, FLUX.2) has no reader for these parts: its converters would take `lora_te1_…` for a denoiser layer and
`text_encoder.…` for a component the pipeline lacks. They are set apart before any reader sees the file
(`set_apart_text_encoders`), and --text-encoder-layers decides what becomes of them (admission.py): dropped with a
warning under ignore, refused saying so under apply. A family that lists text encoders reads these names itself,
through its kohya_prefixes and its converter, as it always did.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from loraswap.server.engine.errors import AdapterFormatError, ErrorReason
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.types import ModelFamily

# A text encoder's first name in diffusers' and PEFT's keys.
DIFFUSERS_TEXT_ENCODER = re.compile(r"(text_encoder(?:_[0-9]+)?)\.")
# A text encoder's layer-name prefix in kohya's, before `_<module path>`.
KOHYA_TEXT_ENCODER = re.compile(r"(lora_te[1-3]?)_")


def text_encoder_of(key: str) -> str | None:
    """The text encoder a key belongs to, as the file names it (`text_encoder_2`, `lora_te1`); None for a key of
    no text encoder."""
    named = DIFFUSERS_TEXT_ENCODER.match(key) or KOHYA_TEXT_ENCODER.match(key)
    return named[1] if named else None


def set_apart_text_encoders(
    state_dict: dict[str, torch.Tensor], family: ModelFamily, denoiser: str
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(the file without its text-encoder parts, how many tensors each of them has) for a family that lists no text
    encoders; for any other family the file itself, and nothing set apart.

    Raises ADAPTER_NO_DENOISER_LAYERS for a file of text-encoder parts only.
    """
    if FAMILIES[family].text_encoders:
        return state_dict, {}
    parts = {key: part for key in state_dict if (part := text_encoder_of(key)) is not None}
    if not parts:
        return state_dict, {}
    counts = dict(Counter(parts.values()))
    if len(parts) == len(state_dict):
        listed = ", ".join(f"{part} ({count} tensors)" for part, count in sorted(counts.items()))
        raise AdapterFormatError(
            f"the adapter has layers for {listed} only, and none for the {denoiser}; it is not a LoRA for this "
            f"{family.value} model",
            reason=ErrorReason.ADAPTER_NO_DENOISER_LAYERS,
        )
    return {key: value for key, value in state_dict.items() if key not in parts}, counts
