"""The newer families' tiny models as the serving tests use them: each exported as a folder plain diffusers loads,
its built pipeline to write adapters from, and the references a served image must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import builtin_model
from tests.support.reference import DiffusersReference

# model -> family, as GetServerInfo names it
MODELS = {
    "tiny-qwen-image": "qwen-image",
    "tiny-z-image": "z-image",
    "tiny-flux2": "flux2",
    "tiny-flux2-klein": "flux2",
}


class MergedReference(DiffusersReference):
    """Plain diffusers' images, also with dense weight changes added by hand to its weights: the reference for files
    diffusers does not read (a LoHa, layouts its converters miss) and for changes outside the swap slot."""

    def merged_image(self, deltas: dict[str, torch.Tensor], *, prompt: str, seed: int, steps: int, guidance: float,
                     width: int = 64, height: int = 64) -> np.ndarray:  # fmt: skip
        """A fresh pipeline with each denoiser layer's weight plus its ΔW in `deltas` (strength already applied)."""
        pipe = self._pipeline()
        denoiser = family_of(pipe).denoiser(pipe)
        with torch.no_grad():
            for module, delta in deltas.items():
                layer = denoiser.get_submodule(module)
                layer.weight += delta.to(layer.weight.dtype)
        return self._run(pipe, {}, prompt, seed, steps, guidance, width, height)


class FamilyModel:
    """One family's tiny model: its exported folder, its pipeline (to write adapters from), an adapter folder and the
    references of images from both."""

    def __init__(self, model: str, root: Path) -> None:
        self.model = model
        self.family = MODELS[model]
        builtin = builtin_model(model)
        self.defaults = builtin.defaults
        self.folder = builtin.export(root / "model")
        self.adapters = root / "adapters"
        self.adapters.mkdir(parents=True)
        self.pipe = builtin.build()
        self.denoiser = family_of(self.pipe).denoiser(self.pipe)
        self.reference = MergedReference(self.folder, self.family, self.adapters, self.defaults.max_sequence_length)
