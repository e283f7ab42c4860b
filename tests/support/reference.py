"""Reference images from plain diffusers: what a served image must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The call argument each family's pipeline takes a LoRA strength in.
SCALE_ARGUMENT = {
    "flux": "joint_attention_kwargs", "sdxl": "cross_attention_kwargs", "qwen-image": "attention_kwargs",
    "z-image": "joint_attention_kwargs", "flux2": "attention_kwargs",
}  # fmt: skip


class DiffusersReference:
    """Images from a freshly loaded plain-diffusers pipeline with the adapter loaded the standard way."""

    def __init__(self, model_dir: Path, family: str, adapter_dir: Path, max_sequence_length: int | None = 32) -> None:
        self.model_dir = model_dir
        self.family = family
        self.adapter_dir = adapter_dir
        self.max_sequence_length = max_sequence_length  # the tiny models' (SDXL's pipeline takes none)
        self._cache: dict[tuple, np.ndarray] = {}

    def call_arguments(self, guidance: float) -> dict:
        """The guidance and prompt-length arguments, written out per family as diffusers' pipelines name them."""
        if self.family == "sdxl":
            return {"guidance_scale": guidance}
        length = {"max_sequence_length": self.max_sequence_length}
        if self.family == "qwen-image":  # no guidance embedding: true CFG, which needs a negative prompt
            return {**length, "true_cfg_scale": guidance, **({"negative_prompt": ""} if guidance > 1 else {})}
        return {**length, "guidance_scale": guidance}

    def image(self, adapter: str, scale: float, *, prompt: str, seed: int, steps: int, guidance: float,
              width: int = 64, height: int = 64) -> np.ndarray:  # fmt: skip
        key = (adapter, scale, prompt, seed, steps, guidance, width, height)
        if key not in self._cache:
            pipe = self._pipeline()
            kwargs = {}
            if adapter:
                pipe.load_lora_weights(str(self.adapter_dir / adapter))
                kwargs = {SCALE_ARGUMENT[self.family]: {"scale": scale}}
            self._cache[key] = self._run(pipe, kwargs, prompt, seed, steps, guidance, width, height)
        return self._cache[key]

    def stack_image(self, members: list[tuple[str, float]], *, prompt: str, seed: int, steps: int, guidance: float,
                    width: int = 64, height: int = 64) -> np.ndarray:  # fmt: skip
        """Several adapters the way diffusers stacks them: each loaded under its own name, then `set_adapters`."""
        key = ("stack", tuple(members), prompt, seed, steps, guidance, width, height)
        if key not in self._cache:
            pipe = self._pipeline()
            for name, _ in members:
                pipe.load_lora_weights(str(self.adapter_dir / name), adapter_name=name)
            if members:  # none: the base model
                pipe.set_adapters([name for name, _ in members], adapter_weights=[scale for _, scale in members])
            self._cache[key] = self._run(pipe, {}, prompt, seed, steps, guidance, width, height)
        return self._cache[key]

    def _pipeline(self):
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(self.model_dir)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _run(self, pipe, kwargs: dict, prompt: str, seed: int, steps: int, guidance: float, width: int,
             height: int) -> np.ndarray:  # fmt: skip
        kwargs = {**kwargs, **self.call_arguments(guidance)}
        result = pipe(
            prompt=prompt, num_inference_steps=steps, width=width, height=height,
            generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", **kwargs,
        )  # fmt: skip
        return np.asarray(result.images[0].convert("RGB")).astype(np.int32)


class LycorisReference(DiffusersReference):
    """Images from a fresh plain-diffusers pipeline with a LyCORIS file applied by the LyCORIS package's own
    network (tests/support/lycoris_files.py): its modules' forwards compute the adapter at `scale`. SDXL's files are
    its kohya network's (UNet and text encoders); the newer families' its general network's on the transformer."""

    def lycoris_image(self, name: str, scale: float, *, prompt: str, seed: int, steps: int, guidance: float,
                      text_encoders: bool = True, preset: dict | None = None) -> np.ndarray:  # fmt: skip
        from tests.support.lycoris_files import TEST_PRESET, applied_network, applied_transformer_network

        key = ("lycoris", name, scale, prompt, seed, steps, guidance, text_encoders)
        if key not in self._cache:
            pipe = self._pipeline()
            path = self.adapter_dir / f"{name}.safetensors"
            if self.family == "sdxl":
                applied_network(path, pipe, scale, preset or TEST_PRESET, text_encoders=text_encoders)
            else:
                applied_transformer_network(path, pipe.transformer, scale)
            self._cache[key] = self._run(pipe, {}, prompt, seed, steps, guidance, 64, 64)
        return self._cache[key]
