"""What PEFT calls a LoRA layer's tensors, and kohya's name for each: the one table both directions read.

PEFT (and diffusers, which saves PEFT's state dicts) names a layer's factors `lora_A.weight` (down) and
`lora_B.weight` (up), a trained lora_B bias `lora_B.bias` and DoRA's magnitude `lora_magnitude_vector`; kohya's
sd-scripts and LyCORIS name the factors `lora_down.weight` and `lora_up.weight` (key_layouts.LAYER_TENSORS: every
tensor name of theirs). A PEFT model's own state dict writes its adapter name into these names
(`lora_A.default.weight`, `lora_magnitude_vector.default`).

comfy_names.py reads PEFT's factor names as kohya's; diffusers_keys.py reads kohya's as PEFT's and removes the
adapter name.
"""

from __future__ import annotations

import re

# PEFT's name of each LoRA factor -> kohya's.
PEFT_TO_KOHYA = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}
KOHYA_TO_PEFT = {kohya: peft for peft, kohya in PEFT_TO_KOHYA.items()}
# Every tensor of a PEFT LoRA layer: its factors, a trained lora_B bias and DoRA's magnitude (PEFT wrote it without,
# and later with, `.weight`).
PEFT_TENSORS = (*PEFT_TO_KOHYA, "lora_B.bias", "lora_magnitude_vector", "lora_magnitude_vector.weight")
# The adapter name a PEFT model gives an adapter it is not told the name of.
PEFT_ADAPTER_NAME = "default"
# PEFT's adapter name after the name of the module holding a tensor (`.lora_A.default.weight`).
_ADAPTER_NAMED = re.compile(
    rf"\.({'|'.join(sorted({name.partition('.')[0] for name in PEFT_TENSORS}))})\.{PEFT_ADAPTER_NAME}(?=\.|$)"
)


def with_adapter_name(tensor: str) -> str:
    """A PEFT tensor's name as a PEFT model's state dict writes it: `lora_A.weight` -> `lora_A.default.weight`."""
    module, dot, rest = tensor.partition(".")
    return f"{module}.{PEFT_ADAPTER_NAME}{dot}{rest}"


def without_adapter_name(key: str) -> str:
    """`key` with PEFT's adapter name removed from its tensor's name: `….lora_A.default.weight` -> `….lora_A.weight`."""
    return _ADAPTER_NAMED.sub(r".\1", key)
