"""Settings for real servers on ports the OS picks, sized for CI's two cores."""

from __future__ import annotations

from loraswap.server.config import Settings
from loraswap.server.engine.config import EngineConfig

# Two cores at most here; oversubscribing them makes torch crawl (see DEVELOPERS.md).
TEST_TORCH_THREADS = 1


def server_settings(model: str, adapter_dir, **engine) -> Settings:
    """A test server's settings: loopback, port 0, rank-16 slot, aot_eager compile, one torch thread."""
    engine.setdefault("compile", True)
    engine.setdefault("compile_backend", "aot_eager")
    return Settings(
        engine=EngineConfig(
            model=model, adapter_dir=adapter_dir, max_rank=16, torch_threads=TEST_TORCH_THREADS, **engine
        ),
        host="127.0.0.1",
        port=0,
    )
