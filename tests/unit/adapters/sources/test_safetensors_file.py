"""The shared safetensors reader: the header-only read and the whole-file read see one header.

Real files written by safetensors in a temp dir. The LoraConfig checks are in test_canonical.py, hostile
files through a real server in tests/integration/test_hostile_inputs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.sources import (
    LORA_ADAPTER_METADATA_KEY,
    AdapterFile,
    read_adapter_file,
    read_safetensors_metadata,
)
from loraswap.server.engine.errors import AdapterFormatError, AdapterTooLargeError

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


def _read(path: Path):
    return read_adapter_file(AdapterFile(name=path.stem, path=path, source=path.name))


def test_every_tensor_reads_as_safetensors_reads_it_into_a_buffer_of_its_own(tmp_path) -> None:
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(3, 2, 2, generator=generator).to(torch.float16),
        "f32": torch.randn(1, 9, generator=generator),
        "alpha": torch.tensor(8.0),
        "empty": torch.zeros(0, 4),
        "int": torch.arange(6, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "odd": torch.ones(3, dtype=torch.uint8),  # puts what follows at an offset no wider dtype views
        "after": torch.randn(2, 3, generator=generator),
    }
    path = tmp_path / "kinds.safetensors"
    save_file(tensors, str(path))
    read, _ = _read(path)
    expected = {name: tensor.clone() for name, tensor in load_file(str(path)).items()}  # not mapped from the file
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name
    path.write_bytes(bytes(path.stat().st_size))  # the file rewritten: what was read stays as it was
    assert all(torch.equal(read[name], tensor) for name, tensor in expected.items())
    storages = {tensor.untyped_storage().data_ptr() for tensor in read.values() if tensor.numel()}
    assert len(storages) == sum(1 for tensor in read.values() if tensor.numel())
    assert all(tensor.data_ptr() % 16 == 0 for tensor in read.values() if tensor.numel())  # the slot's copies


def _with_header(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "says"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1],
          "data_offsets": [4, 8]}}, bytes(8), "starts at byte 4"),  # overlap
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "starts at byte 4"),  # a hole
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "8 bytes for shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "the file's data 12"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "the file's data 8"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "no dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"r": 4}}, bytes(8),
         "map of text to text"),
        ([1, 2], b"", "not a JSON object"),
    ],
)  # fmt: skip
def test_a_header_safetensors_would_refuse_is_refused(tmp_path, header, data, says) -> None:
    path = _with_header(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(AdapterFormatError) as refused:
        _read(path)
    assert "not a readable safetensors file" in str(refused.value) and says in str(refused.value)


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path) -> None:
    path = _write(tmp_path / "a.safetensors", {})
    with pytest.raises(AdapterTooLargeError):
        read_adapter_file(AdapterFile(name="a", path=path, source="a", max_bytes=path.stat().st_size - 1))
    assert _read(path)[0]
