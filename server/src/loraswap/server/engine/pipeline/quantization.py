"""--quantize: the denoiser's base linear weights stored by torchao; the swap slot's LoRA factors never are.

`int8wo` (int8 weight-only, per output channel) works on CPU and CUDA; `fp8` (float8 dynamic activation and
float8 weight, per-tensor scales) needs a CUDA device of compute capability 8.9 or higher (Ada, Hopper and later) and is
refused at start-up elsewhere. Quantization runs after the swap slot is installed and before any compile: only
the plain `torch.nn.Linear` layers of the denoiser are chosen (a LoRA layer's `base_layer` is one), never the
slot's lora_A / lora_B factors, so swaps remain in-place copies into the same tensors. Fused swaps (--fuse
auto|always) merge into fp8 weights by requantizing them in place from the pristine copies the slot phase took in the
model's dtype, before this ran (adapters/residency/fp8_merges.py); int8wo weights are served unfused only.
"""

from __future__ import annotations

import logging

import torch

from loraswap.server.engine.quantize_options import FP8_MIN_CAPABILITY, quantize_option_problem


def check_quantization(quantization: str, device: str | None) -> None:
    """Refuse a --quantize value this process cannot serve, before anything is loaded.

    Raises:
        ValueError: an unknown value, torchao missing, or fp8 without a CUDA device of capability >= 8.9;
            the message is one line that says what to change.
    """
    problem = quantize_option_problem(quantization)
    if problem is not None:
        raise ValueError(problem)
    if quantization == "none":
        return
    if quantization == "fp8":
        target = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if target.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                f"--quantize fp8 needs a CUDA device of compute capability {_dotted(FP8_MIN_CAPABILITY)} or higher; "
                f"this server runs on {target.type}: use --quantize int8wo or none"
            )
        capability = torch.cuda.get_device_capability(target)
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"--quantize fp8 needs compute capability {_dotted(FP8_MIN_CAPABILITY)} or higher; "
                f"{torch.cuda.get_device_name(target)} has {_dotted(capability)}: use --quantize int8wo or none"
            )
    try:
        _import_torchao()
    except ImportError as error:
        raise ValueError(f"--quantize {quantization} needs torchao (pip install torchao): {error}") from None


def _import_torchao() -> None:
    """Import torchao without its import-time noise: warnings about optional CUDA kernels that fail to load (all
    of them on a CPU) and a torch pytree deprecation note, printed before logging is configured."""
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in noisy]
    for logger in noisy:
        logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    finally:
        for logger, level in zip(noisy, levels, strict=True):
            logger.setLevel(level)


def _dotted(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def _is_base_linear(module: torch.nn.Module, name: str) -> bool:
    # Exactly nn.Linear: the slot's RankGatedLinear subclasses it, and PEFT's lora_A / lora_B are nn.Linear too.
    return type(module) is torch.nn.Linear and ".lora_A." not in f".{name}." and ".lora_B." not in f".{name}."


def quantize_denoiser(denoiser: torch.nn.Module, quantization: str) -> None:
    """Quantize the denoiser's base linear weights in place (nothing for `none`); call after the slot is in."""
    if quantization == "none":
        return
    _import_torchao()
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    # set_inductor_config=False: torchao would otherwise turn on inductor's coordinate-descent tuning (in all
    # directions) for the whole process, so every Triton kernel the warm-up compiles is benchmarked in many variants,
    # each compiled on the host: fp8 start-ups on an H200 ran 220-340 s with the GPU 0-10% busy. Tuning belongs to
    # --compile-mode (max-autotune turns it on); ostris/ai-toolkit#951 measured 5-10x faster compiles without it
    # for about 2% slower steps.
    config = (
        Int8WeightOnlyConfig(set_inductor_config=False)
        if quantization == "int8wo"
        # Per-tensor scales, torchao's default and the diffusers fast-LoRA recipe's: on torch 2.11 + CUDA 13 the
        # per-row variant's compiled _scaled_mm failed on an H200 (CUBLAS_STATUS_NOT_SUPPORTED, BENCHMARKS.md).
        # Fused merges (adapters/residency/fp8_merges.py) write these per-tensor weights in place.
        else Float8DynamicActivationFloat8WeightConfig(set_inductor_config=False)
    )
    quantize_(denoiser, config, filter_fn=_is_base_linear)


def _stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor takes as stored: a torchao tensor subclass counts its inner tensors (data, scales)."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        inner_names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(getattr(tensor, inner)) for inner in inner_names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers as stored, quantized or not (each tensor counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += _stored_bytes(tensor)
    return total
