"""An engine double for real servers whose tests are about the wire, not the pipeline (keepalive, large images).

`serving(scripted_settings(), engine=ScriptedEngine(...))` (tests/support/servers.py) serves it through the real
transport: the servicer, the conversions, the error table, the server's options. Generate runs whatever script the
test gives.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable

import numpy as np
from PIL import Image

from loraswap.server.engine.errors import AdapterNotFoundError
from loraswap.server.engine.observer import EngineGauges
from loraswap.server.engine.types import (
    AdapterCacheSummary,
    GeneratedImage,
    GenerationEvent,
    GenerationRequest,
    ImageFormat,
    ModelFamily,
    PreloadResult,
    ServerDescription,
    StepProgress,
    Timings,
)

GenerationScript = Callable[[GenerationRequest], AsyncIterator[GenerationEvent]]


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels: it barely compresses, so its size is about 3 bytes per pixel."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def finished_image(data: bytes, request: GenerationRequest, width: int, height: int) -> GeneratedImage:
    """The GeneratedImage a generation of `request` ends with, holding `data`."""
    return GeneratedImage(
        data=data, image_format=ImageFormat.PNG, width=width, height=height, seed=request.seed or 0,
        adapter=request.adapter, adapter_scale=1.0, timings=Timings(total_ms=1.0), warnings=("scripted",),
    )  # fmt: skip


class ScriptedEngine:
    """An Engine (loraswap.server.engine.interface) standing in for DiffusionEngine: starts at once, and each
    Generate runs `script(request)`. tests/unit/test_engine_interface.py holds it to the Engine's signatures."""

    def __init__(self, script: GenerationScript) -> None:
        self.script = script
        self.accepting = True

    async def start(self) -> None:
        pass

    def stop_accepting(self) -> None:
        self.accepting = False

    async def drain(self, timeout: float) -> bool:
        return True

    def abort_all(self, message: str) -> None:
        pass

    async def stop(self, timeout: float | None = None) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        async for event in self.script(request):
            yield event

    async def preload(self, name: str, link: str | None = None) -> PreloadResult:
        raise AdapterNotFoundError(f"the scripted engine has no adapter {name!r}")

    def reload_url_tokens(self) -> bool:
        return False

    def evict(self, name: str) -> int:
        raise AdapterNotFoundError(f"the scripted engine has no adapter {name!r}")

    def list_adapters(self) -> AdapterCacheSummary:
        return AdapterCacheSummary(adapters=(), cache_bytes=0, cache_budget_bytes=0)

    def gauges(self) -> EngineGauges:
        return EngineGauges(queue_depth=0, cache_bytes=0, cache_entries=0, recompilations=0, swaps=0)

    def describe(self) -> ServerDescription:
        return ServerDescription(
            model="scripted", family=ModelFamily.FLUX, dtype="float32", device="cpu", max_rank=16,
            target_layers=(), compiled=False, recompilations=0, resident_adapter="", size_multiple=16,
            min_size=16, max_size=2048, default_width=64, default_height=64, default_num_inference_steps=1,
            default_guidance_scale=1.0,
        )  # fmt: skip


async def one_step(request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
    """A one-step generation of the request's size."""
    yield StepProgress(step=1, total_steps=1, elapsed_ms=1.0)
    width, height = request.width or 64, request.height or 64
    yield finished_image(noise_png(width, height, request.seed or 0), request, width, height)
