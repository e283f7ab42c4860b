"""The shared safetensors reader: the header-only read and the whole-file read see one header.

Real files written by safetensors in a temp dir. The LoraConfig checks are in test_canonical.py, hostile
files through a real server in tests/integration/test_hostile_inputs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.safetensors_file import (
    LORA_ADAPTER_METADATA_KEY,
    read_adapter_file,
    read_safetensors_metadata,
)
from loraswap.server.engine.adapters.sources import AdapterFile

LORA_CONFIG = {"r": 4, "lora_alpha": 8, "rank_pattern": {}, "alpha_pattern": {"blocks.0.attn": 2}}


def _write(path: Path, metadata: dict[str, str]) -> Path:
    tensors = {"transformer.x.lora_A.weight": torch.ones(4, 8), "transformer.x.lora_B.weight": torch.zeros(8, 4)}
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_both_reads_agree_on_the_metadata(tmp_path) -> None:
    metadata = {"format": "pt", "base_model": "sdxl", LORA_ADAPTER_METADATA_KEY: json.dumps(LORA_CONFIG)}
    path = _write(tmp_path / "a.safetensors", metadata)
    assert read_safetensors_metadata(path) == metadata
    tensors, lora_config = read_adapter_file(AdapterFile(name="a", path=path, source="a.safetensors"))
    assert lora_config == LORA_CONFIG
    assert json.loads(read_safetensors_metadata(path)[LORA_ADAPTER_METADATA_KEY]) == lora_config
    assert sorted(tensors) == ["transformer.x.lora_A.weight", "transformer.x.lora_B.weight"]


def test_a_header_over_the_size_limit_declares_nothing(tmp_path) -> None:
    """The header-only read stops at the adapter size limit: a header larger than the whole allowed file is not read."""
    path = _write(tmp_path / "a.safetensors", {"base_model": "sdxl"})
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert read_safetensors_metadata(path, max_bytes=header_length) == {"base_model": "sdxl"}
    assert read_safetensors_metadata(path, max_bytes=header_length - 1) == {}
