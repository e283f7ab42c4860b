"""What an adapter's folder holds, in the adapter directory or a Hub snapshot alike: the weight file to read (never a
pickle), the model card beside it, and the size limit the file found must keep.
"""

from __future__ import annotations

from pathlib import Path

from loraswap.server.engine.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    ErrorReason,
    shorten,
)

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# A Hugging Face model card; its YAML front matter may declare the adapter's base model.
MODEL_CARD_NAME = "README.md"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_file_size(path: Path, max_bytes: int) -> None:
    """Refuse an adapter file over `max_bytes` (--max-adapter-bytes; 0: no limit) before anything reads it."""
    size = path.stat().st_size
    if max_bytes and size > max_bytes:
        raise AdapterTooLargeError(
            f"adapter file {shorten(path.name)} is {size} bytes, over the server's limit of {max_bytes} "
            "(--max-adapter-bytes); use a smaller rank or fewer layers",
            file_bytes=size,
            max_bytes=max_bytes,
        )


def pick_weight_file(folder: Path, label: str) -> Path:
    """The adapter file inside a folder: diffusers' standard name, else the only .safetensors."""
    standard = folder / DIFFUSERS_WEIGHT_NAME
    if standard.is_file():
        return standard
    candidates = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        names = shorten(", ".join(p.name for p in candidates))
        raise AdapterFormatError(
            f"{shorten(label)} holds several .safetensors files ({names}); name one of them, "
            f"e.g. {shorten(label)}/{shorten(candidates[0].stem)}"
        )
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterFormatError(
            f"{shorten(label)} holds only pickle files ({shorten(', '.join(pickles))}); loraswap reads safetensors "
            "only, convert the adapter to .safetensors",
            reason=ErrorReason.ADAPTER_PICKLE_REFUSED,
        )
    raise AdapterNotFoundError(f"{shorten(label)} holds no .safetensors file")
