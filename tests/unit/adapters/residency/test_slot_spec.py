"""The slot spec a runtime gives adapters: --text-encoder-layers as configured, beside whether this server can merge
text-encoder layers at all (a writer for them: FLUX.1's and SDXL's text encoders under apply, none for the families
diffusers loads no text-encoder LoRA for)."""

from __future__ import annotations

import pytest

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.startup import start_runtime


@pytest.mark.parametrize(
    ("model", "policy", "merges"),
    [("tiny-flux", "apply", True), ("tiny-flux", "ignore", False), ("tiny-qwen-image", "apply", False)],
)
def test_the_configured_policy_and_whether_a_writer_merges_are_apart(model: str, policy: str, merges: bool) -> None:
    config = EngineConfig(model=model, compile=False, warmup=False, torch_threads=1, text_encoder_layers=policy)
    spec = start_runtime(config).slot_spec()
    assert (spec.text_encoder_layers, spec.merges_text_encoders) == (policy, merges)
