"""Attention kernels: TFLOP/s of each installed attention backend, on FLUX's shape and on the model's own.

    python -m benchmarks.attention_kernels                      # on a GPU: prints one JSON object
    python -m benchmarks.attention_kernels --device cpu --model tiny-flux --shape 1,2,64,16 --calls 2  # smoke

The backends are those the server's start-up measures on a Hopper GPU when --attention is unset
(engine/pipeline/attention.py: FlashAttention 3 and 2 when their packages are installed, torch's cuDNN, flash and
memory-efficient SDPA; never a `*_hub` one), and `native` (torch's own choice), timed as the start-up times them:
through diffusers' dispatcher in the denoiser's layout, one untimed call, then --calls calls timed with CUDA events
(the wall clock on a CPU), median. A backend that raises or disagrees with native is listed under `skipped`.

Two shapes (batch, heads, tokens, head size): FLUX.1 at 1024² with 512 T5 tokens, (1, 24, 4608, 128), the shape of
the published figures (H100: FA2 330 TFLOP/s, cuDNN and FA3 630), or --shape instead; and --model's own at its
default size, the one the start-up measures (random-flux serves 128² with 32 tokens by default: (1, 24, 96, 128)).
For each: TFLOP/s and ms per call by backend, the fastest, and the SDPA kernel torch takes for `native`. The last
line printed is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.swap import in_process_prelude, log, machine_info

FLUX_1024 = (1, 24, 4608, 128)
DEFAULT_MODEL = "random-flux"
DEFAULT_LAYERS = 1  # the attention shape does not depend on the depth; one block builds in seconds


def _shape_argument(text: str) -> tuple[int, int, int, int]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give batch,heads,tokens,head_dim as four positive integers, not {text!r}")
    return values  # type: ignore[return-value]


def measure_shape(shape, dtype, device, calls: int) -> dict:
    """Every installed backend and native on `shape`: TFLOP/s, ms per call, skipped ones, the fastest backend."""
    from loraswap.server.engine.pipeline import attention

    backends = attention.installed_backends()
    timings = attention.time_backends((*backends, attention.NATIVE), shape, dtype, device, calls)
    log(f"{shape}: {timings.summary()}")
    return {
        "shape": [shape.batch, shape.heads, shape.tokens, shape.head_dim],
        "tflops": {name: float(f"{value:.4g}") for name, value in timings.tflops().items()},
        "ms": {name: round(seconds * 1000, 4) for name, seconds in timings.seconds.items()},
        "skipped": timings.skipped,
        "fastest": attention.fastest({name: s for name, s in timings.seconds.items() if name in backends}),
        "native_kernel": attention.sdpa_kernel(shape, dtype, device),
        "measure_ms": round(timings.elapsed_s * 1000, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the JSON result as the last line of stdout, and return it."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention_kernels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in model or diffusers folder whose shape to add")
    parser.add_argument("--layers", type=int, default=None, help=f"random-flux: blocks kept (default {DEFAULT_LAYERS})")
    parser.add_argument("--shape", type=_shape_argument, default=FLUX_1024, help="batch,heads,tokens,head_dim")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per backend, after one untimed")
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads (default: every core)"
    )
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be at least 1; got {args.calls}")
    in_process_prelude(args.threads)

    import torch

    from loraswap.server.engine.config import EngineConfig
    from loraswap.server.engine.pipeline.attention import AttentionShape, attention_shape
    from loraswap.server.engine.pipeline.startup import load

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layers = args.layers
    if layers is None and args.model == DEFAULT_MODEL:
        layers = DEFAULT_LAYERS
    log(f"loading {args.model} for its attention shape")
    loaded = load(
        EngineConfig(model=args.model, device=args.device, dtype=args.dtype, layers=layers, torch_threads=args.threads)
    )
    model_shape = attention_shape(loaded)
    del loaded
    shapes = {
        "reference": measure_shape(AttentionShape(*args.shape), dtype, device, args.calls),
        # None for SDXL: its UNet calls torch itself, so no backend changes what it runs.
        "model": None if model_shape is None else measure_shape(model_shape, dtype, device, args.calls),
    }
    result = {
        "model": args.model,
        "device": str(device),
        "dtype": args.dtype,
        "calls": args.calls,
        "shapes": shapes,
        "environment": machine_info(),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
