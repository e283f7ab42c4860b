"""`--model random-flux --layers N`: the full-width Flux architecture, cut to N blocks, as a servable runtime."""

from __future__ import annotations

import pytest
import torch

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.startup import start_runtime

torch.set_num_threads(1)


def test_random_flux_runtime_has_full_width_layers_and_bf16_slot():
    runtime = start_runtime(EngineConfig(model="random-flux", layers=1, max_rank=8, compile=False, warmup=False))
    assert runtime.loaded.dtype == torch.bfloat16  # the default for full-size random models, even on CPU
    assert runtime.request_rules.size_multiple == 16
    spec = runtime.slot_spec()
    assert spec.layer_shapes["transformer_blocks.0.attn.to_q"] == (3072, 3072)
    assert not any(name.startswith("transformer_blocks.1.") for name in spec.layer_shapes)


def test_layers_is_refused_for_other_models():
    with pytest.raises(ValueError, match="random-flux"):
        start_runtime(EngineConfig(model="tiny-flux", layers=2, compile=False, warmup=False))
