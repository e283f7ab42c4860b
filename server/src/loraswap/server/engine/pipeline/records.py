"""What each start-up phase makes (startup.py), in the order the phases run; DiffusionRuntime is built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraswap.server.engine.adapters.formats import ModelLayers
from loraswap.server.engine.adapters.residency import AdapterResidency
from loraswap.server.engine.compile_options import compile_mode_label
from loraswap.server.engine.families import FamilyTraits
from loraswap.server.engine.fuse_policy import LoraWork
from loraswap.server.engine.pipeline.compile import CountingBackend
from loraswap.server.engine.pipeline.cpu_threads import CoreShare, FixedThreads
from loraswap.server.engine.pipeline.previews import LatentPreviewer
from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import ModelDefaults


@dataclass(frozen=True)
class LoadedModel:
    """The load phase's product: the pipeline on its device, its family's traits, and the rules for requests."""

    pipe: Any  # a diffusers pipeline of the family
    traits: FamilyTraits
    device: torch.device
    dtype: torch.dtype
    threads: CoreShare | FixedThreads  # --torch-threads, or the cores other processes leave free
    defaults: ModelDefaults
    request_rules: RequestRules
    previewer: LatentPreviewer

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.traits.denoiser(self.pipe)


@dataclass(frozen=True)
class InstalledSlot:
    """The slot phase's product: the swap slot on the denoiser's target layers, with its writers."""

    residency: AdapterResidency  # the slot, the fused writers (denoiser, text encoders) and the device hot set
    model_layers: ModelLayers  # every layer of the denoiser and text encoders a merge can reach
    target_layers: tuple[str, ...]
    device_adapter_bytes: int  # device memory for the hot set of adapters (CUDA only; else 0)
    pristine_bytes: int = 0  # the pristine copies taken at start-up (the slot layers', --fuse auto|always; else 0)
    lora_work: LoraWork | None = None  # what a step's LoRA branch does per rank (--fuse auto's cost model); else None


@dataclass(frozen=True)
class StoredWeights:
    """The quantize phase's product: how the denoiser's base linear weights are stored, and their bytes."""

    quantization: str
    denoiser_weight_bytes: int


@dataclass(frozen=True)
class CompiledDenoiser:
    """The compile phase's product: the attention backend the graphs trace and how torch.compile covers them."""

    kind: str  # none, full or regional
    mode: str  # the mode compiled with (a CUDA-graph mode runs as its graph-free twin off CUDA)
    attention_backend: str
    backend: CountingBackend | None  # counts the graphs compiled; None when not compiled

    @property
    def compiled(self) -> bool:
        return self.kind != "none"

    @property
    def label(self) -> str:
        """How the denoiser is compiled, as GetServerInfo.compile_mode says it: `full/default`, `regional/...`, `none`."""
        return compile_mode_label(self.kind, self.mode)

    @property
    def graphs_compiled(self) -> int:
        """Graphs compiled since start-up (0 when not compiled)."""
        return self.backend.graphs_compiled if self.backend is not None else 0


@dataclass(frozen=True)
class WarmedUp:
    """The warm-up phase's product: the graphs compiled by the end of it, and the buckets that have one unfused."""

    # The rank buckets a stack may compute at unfused without compiling: those warmed up (compiled), every bucket
    # when the denoiser is not compiled or not warmed up (nothing compiled is at stake).
    unfused_buckets: frozenset[int]
    graphs_at_ready: int  # graphs compiled by the end of the warm-up: every later one is a recompilation
