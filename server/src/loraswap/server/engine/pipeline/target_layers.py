"""The denoiser layers the swap slot covers, from --target-modules patterns (or the family's defaults)."""

from __future__ import annotations

import torch


def resolve_target_layers(denoiser: torch.nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Names of the Linear layers whose name is, or ends with '.' + , one of the patterns."""
    names = [
        name
        for name, module in denoiser.named_modules()
        if isinstance(module, torch.nn.Linear)
        and any(name == pattern or name.endswith("." + pattern) for pattern in patterns)
    ]
    if not names:
        raise ValueError(f"--target-modules {', '.join(patterns)} match no linear layer of the model")
    return names
