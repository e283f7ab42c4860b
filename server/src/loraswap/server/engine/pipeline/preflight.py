"""Pre-flight: whether this process can serve an EngineConfig, asked before anything is loaded.

EngineConfig checks what its values alone decide and imports no torch. What depends on the machine and its
packages (fp8 needs a CUDA device of capability 8.9 or higher and torchao; an --attention backend must be one
diffusers knows and, on CUDA, have its package installed) is asked here: by `loraswap serve` as soon as its
settings are parsed, so that a bad flag exits 2 in one line before the model loads, and by start_runtime first.
"""

from __future__ import annotations

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.attention import check_attention
from loraswap.server.engine.pipeline.quantization import check_quantization
from loraswap.server.engine.setting_spec import check_setting


def preflight(config: EngineConfig) -> None:
    """Refuse what this process cannot serve of `config` (--quantize, --attention), before anything is loaded.

    Raises:
        SettingsError: the first refusal, one line that says what to change.
    """
    if config.quantize != "none":
        check_setting(check_quantization, config.quantize, config.device)
    if config.attention is not None:
        check_setting(check_attention, config.attention, config.device)
