"""The pre-flight (engine/pipeline/preflight.py): what this process cannot serve, refused in one line before a load.

EngineConfig checks what its values decide and imports no torch; whether fp8 has its CUDA device and an
--attention backend is one diffusers knows is the pre-flight's question. (--attention's other refusals, and
`serve` asking the pre-flight, are in test_attention_and_device_options.py.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraswap.server.engine.config import EngineConfig, SettingsError
from loraswap.server.engine.pipeline.preflight import preflight
from loraswap.server.engine.pipeline.quantization import check_quantization


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (dict(quantize="fp8", device="cpu"),
         ("--quantize fp8 needs a CUDA device of compute capability 8.9 or higher; this server runs on cpu: "
          "use --quantize int8wo or none")),
        (dict(attention="warp-drive", device="cpu"), "--attention 'warp-drive' is not an attention backend; use one of"),
        # Quantization is asked first, as EngineConfig asked it before the attention backend.
        (dict(quantize="fp8", attention="warp-drive", device="cpu"), "--quantize fp8 needs a CUDA device"),
    ],
)  # fmt: skip
def test_what_this_process_cannot_serve_is_refused_in_one_line(changes: dict, says: str) -> None:
    config = EngineConfig(**changes)  # the config itself takes it: its values are valid ones
    with pytest.raises(SettingsError) as refused:
        preflight(config)
    message = str(refused.value)
    assert message.startswith(says) and "\n" not in message


@pytest.mark.parametrize(
    "changes", [dict(), dict(quantize="int8wo"), dict(attention="native"), dict(attention="FLASH")]
)
def test_what_this_process_can_serve_passes(changes: dict) -> None:
    preflight(EngineConfig(device="cpu", **changes))


def test_an_unknown_quantization_is_refused_by_the_config_itself_with_the_same_words() -> None:
    with pytest.raises(SettingsError) as refused:
        EngineConfig(quantize="int4")
    assert str(refused.value) == "--quantize 'int4' is not one of none, int8wo, fp8"
    with pytest.raises(ValueError, match="^--quantize 'int4' is not one of none, int8wo, fp8$"):
        check_quantization("int4", None)


def test_making_a_config_imports_neither_torch_nor_diffusers() -> None:
    # The device checks are the pre-flight's: a config naming fp8 and an attention backend is plain values.
    probe = (
        "import sys\n"
        "from loraswap.server.engine.config import EngineConfig\n"
        "EngineConfig(quantize='fp8', attention='flash', device='cuda')\n"
        "print(','.join(sorted(m for m in ('torch', 'diffusers', 'torchao') if m in sys.modules)))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""
