"""Settings for real servers on ports the OS picks, sized for CI's two cores."""

from __future__ import annotations

from loraswap.server.config import Settings
from loraswap.server.engine.config import EngineConfig

# Two cores at most here; oversubscribing them makes torch crawl (see DEVELOPERS.md).
TEST_TORCH_THREADS = 1
# The backend compiled test servers hand dynamo's graphs to. Whether a request recompiles is decided by
# dynamo's guards; eager runs each captured graph as it is, skipping AOTAutograd's second trace, which made
# warm-ups two to three times longer here and every compiled step twice as slow. The no-recompilation tests
# still catch what they were written for under eager: with pipeline/compile.py's oneDNN switch undone, a
# compiled tiny-sdxl recompiles 6 times over test_swaps.SDXL_SIZES. test_inductor.py compiles as served.
TEST_COMPILE_BACKEND = "eager"


def server_settings(model: str, adapter_dir, **engine) -> Settings:
    """A test server's settings: loopback, port 0, rank-16 slot, compiled (TEST_COMPILE_BACKEND), one torch thread."""
    engine.setdefault("compile", True)
    engine.setdefault("compile_backend", TEST_COMPILE_BACKEND)
    return Settings(
        engine=EngineConfig(
            model=model, adapter_dir=adapter_dir, max_rank=16, torch_threads=TEST_TORCH_THREADS, **engine
        ),
        host="127.0.0.1",
        port=0,
    )
