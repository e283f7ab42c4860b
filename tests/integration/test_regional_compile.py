"""--compile regional through a real server: the repeated blocks compiled, swaps exact, nothing recompiles."""

from __future__ import annotations

import pytest

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.startup import start_runtime
from tests.support.images import assert_images_close, decode
from tests.support.servers import TEST_TORCH_THREADS, client_of, serving

PROMPT = "a lighthouse at dusk"
SEQUENCE = [("r4-attn", 1.0), ("r16-mlp", 0.7), ("", 1.0)]  # other ranks, layers and strengths, then the base
STACK = [("r4-attn", 0.8), ("r8-context", 1.0)]


@pytest.mark.asyncio(loop_scope="session")
async def test_regional_compile_swaps_match_diffusers_without_recompiling(flux_adapter_dir, flux_reference):
    # dynamo's guards decide recompilation; the test backend (eager) has them without inductor's code generation.
    async with serving("tiny-flux", flux_adapter_dir, compile="regional") as running:
        denoiser = running.engine.runtime.denoiser
        compiled_blocks = [
            module for module in denoiser.modules() if getattr(module, "_compiled_call_impl", None) is not None
        ]
        assert compiled_blocks and {type(block).__name__ for block in compiled_blocks} == set(denoiser._repeated_blocks)
        assert getattr(denoiser, "_compiled_call_impl", None) is None  # the denoiser itself stays eager
        async with client_of(running, default_timeout=300) as client:
            info = await client.server_info()
            assert (info.compiled, info.compile_mode) == (True, "regional/default")
            for adapter, scale in SEQUENCE:
                image = await client.generate_image(
                    PROMPT, adapter=adapter, adapter_scale=scale, seed=11, num_inference_steps=4
                )
                expected = flux_reference.image(
                    adapter, scale, prompt=PROMPT, seed=11, steps=4, guidance=info.default_guidance_scale
                )
                assert_images_close(decode(image.data), expected)
            image = await client.generate_image(PROMPT, adapters=STACK, seed=11, num_inference_steps=4)
            expected = flux_reference.stack_image(
                STACK, prompt=PROMPT, seed=11, steps=4, guidance=info.default_guidance_scale
            )
            assert_images_close(decode(image.data), expected)
            assert (await client.server_info()).recompilations == 0


@pytest.mark.parametrize(
    ("compile", "mode", "label"),
    [("full", "reduce-overhead", "full/default"), ("regional", "max-autotune", "regional/max-autotune-no-cudagraphs"),
     ("none", "default", "none"), (None, "default", "none")],
)  # fmt: skip
def test_compile_mode_as_the_server_reports_it_on_cpu(compile, mode, label):
    """On the CPU the CUDA-graph modes compile as their graph-free twins, and GetServerInfo says so."""
    runtime = start_runtime(
        EngineConfig(
            model="tiny-flux", device="cpu", compile=compile, compile_mode=mode, warmup=False,
            torch_threads=TEST_TORCH_THREADS,
        )
    )  # fmt: skip
    assert runtime.compiled.label == label
    assert runtime.compiled.compiled is (label != "none")


def test_regional_compile_needs_repeated_blocks():
    """A denoiser without diffusers' `_repeated_blocks` is refused with one line that names the way out."""
    import torch

    from loraswap.server.engine.pipeline.compile import compile_counting

    with pytest.raises(ValueError, match="--compile full") as refused:
        compile_counting(torch.nn.Linear(2, 2), "eager", kind="regional")
    assert "\n" not in str(refused.value)
