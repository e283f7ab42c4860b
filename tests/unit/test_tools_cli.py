"""`loraswap make-adapter` and `loraswap export-model` write files plain diffusers loads."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline

from loraswap.client.command import main


def test_export_model_then_make_adapter_load_in_plain_diffusers(tmp_path, capsys):
    assert main(["export-model", "tiny-flux", str(tmp_path / "model")]) == 0
    assert main(["make-adapter", "--model", str(tmp_path / "model"), "--rank", "8", "-o", str(tmp_path / "a")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rank"] == 8
    pipe = FluxPipeline.from_pretrained(tmp_path / "model")
    pipe.load_lora_weights(str(tmp_path / "a"))
    lora_a = pipe.transformer.transformer_blocks[0].attn.to_q.lora_A["default_0"].weight
    assert lora_a.shape == (8, pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim)
    assert lora_a.abs().sum() > 0


def test_make_adapter_for_builtin_sdxl(tmp_path):
    assert main(["make-adapter", "--model", "tiny-sdxl", "--rank", "4", "--target-modules", "to_q,to_v",
                 "-o", str(tmp_path / "s")]) == 0  # fmt: skip
    from loraswap.server.engine.models import builtin_model

    pipe = builtin_model("tiny-sdxl").build()
    assert isinstance(pipe, StableDiffusionXLPipeline)
    pipe.load_lora_weights(str(tmp_path / "s"))
    targeted = {name for name, module in pipe.unet.named_modules() if hasattr(module, "lora_A") and module.lora_A}
    assert targeted and all(name.endswith(("to_q", "to_v")) for name in targeted)
    assert torch.is_tensor(next(iter(pipe.unet.parameters())))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["export-model", "no-such-model", "DIR"], "unknown builtin model 'no-such-model'"),
        (["export-model", "random-flux", "DIR"], "random-flux is not exported"),
        (["make-adapter", "--model", "no-such-model", "-o", "DIR"], "unknown model 'no-such-model'"),
        (["demo", "--model", "no-such-model", "--out", "DIR"], "unknown model 'no-such-model'"),
    ],
    ids=["export-unknown", "export-not-exported", "make-adapter-unknown", "demo-unknown"],
)
def test_a_bad_model_name_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    argv = [str(tmp_path / "out") if arg == "DIR" else arg for arg in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"loraswap {argv[0]}: ") and says in lines[0], captured.err
    assert "Traceback" not in captured.err and not (tmp_path / "out").exists()
