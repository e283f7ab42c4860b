"""Reference images from plain diffusers: what a served image must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class DiffusersReference:
    """Images from a freshly loaded plain-diffusers pipeline with the adapter loaded the standard way."""

    def __init__(self, model_dir: Path, family: str, adapter_dir: Path) -> None:
        self.model_dir = model_dir
        self.family = family
        self.adapter_dir = adapter_dir
        self._cache: dict[tuple, np.ndarray] = {}

    def image(self, adapter: str, scale: float, *, prompt: str, seed: int, steps: int, guidance: float,
              width: int = 64, height: int = 64) -> np.ndarray:  # fmt: skip
        key = (adapter, scale, prompt, seed, steps, guidance, width, height)
        if key not in self._cache:
            from diffusers import DiffusionPipeline

            pipe = DiffusionPipeline.from_pretrained(self.model_dir)
            pipe.set_progress_bar_config(disable=True)
            kwargs = {}
            if adapter:
                pipe.load_lora_weights(str(self.adapter_dir / adapter))
                attention_kwargs = {"scale": scale}
                kwargs = (
                    {"joint_attention_kwargs": attention_kwargs}
                    if self.family == "flux"
                    else {"cross_attention_kwargs": attention_kwargs}
                )
            if self.family == "flux":
                kwargs["max_sequence_length"] = 32
            result = pipe(
                prompt=prompt, num_inference_steps=steps, guidance_scale=guidance, width=width, height=height,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", **kwargs,
            )  # fmt: skip
            self._cache[key] = np.asarray(result.images[0].convert("RGB")).astype(np.int32)
        return self._cache[key]
