"""What `--quantize` may say, and the device fp8 needs. Plain values, no torch.

A leaf: the engine's settings (engine/config.py) offer these choices, and the quantization itself
(engine/pipeline/quantization.py, torchao) checks and applies them; neither imports the other for them.
"""

from __future__ import annotations

# How the denoiser's base linear weights are stored: as loaded, int8 weight-only, or float8.
QUANTIZATIONS = ("none", "int8wo", "fp8")
# Those fused swaps can merge adapters into (--fuse auto|always): float8 weights are requantized from pristine
# copies in place (adapters/residency/fp8_merges.py); int8 weight-only weights are served unfused only (per-channel int8 has
# no in-place writer here).
FUSABLE_QUANTIZATIONS = ("none", "fp8")
# fp8 needs a CUDA device of this compute capability or higher (Ada, Hopper and later).
FP8_MIN_CAPABILITY = (8, 9)


def quantize_option_problem(quantization: str) -> str | None:
    """One line saying what to change when `--quantize` is none of QUANTIZATIONS; None when it is one."""
    if quantization not in QUANTIZATIONS:
        return f"--quantize {quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
    return None
