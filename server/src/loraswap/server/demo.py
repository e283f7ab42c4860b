"""`loraswap demo`: the main job on one machine, offline.

Starts a real server on a port the OS picks, with the built-in model compiled,
and has a real client generate one prompt with the base model, two adapters,
one of them at half strength, and the base model again, streaming each step
and writing each image. On `shapes` (the default) the adapters are the shipped
`outline` and `swap-colors`, so the restyling shows in the pictures; on the
random-weight models two random adapters are written with PEFT first. It prints
one JSON summary, which ends with the number of graph recompilations the swaps
caused (0 is the point). The first generation also asks for step previews
(Progress.preview) and lays them out, with the final image, in previews.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

SHAPES_PROMPT = "a red circle on a blue background"
SHAPES_ADAPTERS = ("outline", "swap-colors")
RANDOM_PROMPT = "a lighthouse on a cliff at dusk"
RANDOM_ADAPTERS = {"style-a": dict(rank=4, alpha=8.0, seed=1), "style-b": dict(rank=8, alpha=4.0, seed=2)}
PREVIEWS_IN_STRIP = 5


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    parser = subparsers.add_parser("demo", help="run a server and a client swapping two adapters against it")
    parser.add_argument("--model", default="shapes", help="built-in model (shapes, tiny-flux, tiny-sdxl)")
    parser.add_argument("--prompt", default=None, help=f"default: {SHAPES_PROMPT!r} on shapes")
    parser.add_argument("--out", default="out", help="folder for the adapters and images")
    parser.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.set_defaults(func=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    from loraswap.server.devtools.commands import local_model_problem, refuse
    from loraswap.server.engine.errors import StartupError
    from loraswap.server.engine.quiet_imports import quiet_foreign_packages

    problem = local_model_problem(args.model)
    if problem is not None:
        return refuse("demo", problem)
    quiet_foreign_packages("none")  # the demo quantizes nothing

    try:
        summary = asyncio.run(
            run_demo(args.model, Path(args.out), args.compile_backend, args.torch_threads, args.prompt)
        )
    except (ValueError, StartupError) as error:  # a model it cannot load: one line, as `loraswap serve` answers
        return refuse("demo", error)
    print(json.dumps(summary, indent=2))
    return 0 if summary["recompilations"] == 0 else 1


def _demo_adapters(model: str, out: Path) -> tuple[Path, tuple[str, ...], str]:
    """(adapter directory, two adapter names, default prompt) for the model."""
    from loraswap.server.engine.models import BUILTINS, load_pipeline

    builtin = BUILTINS.get(model)
    if builtin is not None and builtin.adapter_dir is not None:  # shapes: its shipped adapters
        return builtin.adapter_dir, SHAPES_ADAPTERS, SHAPES_PROMPT
    import torch

    from loraswap.server.devtools.random_adapter import write_random_adapter

    pipe = load_pipeline(model, torch.float32)
    for name, spec in RANDOM_ADAPTERS.items():
        write_random_adapter(pipe, out / "adapters" / name, init_std=0.2, **spec)
    return out / "adapters", tuple(RANDOM_ADAPTERS), RANDOM_PROMPT


async def run_demo(
    model: str, out: Path, compile_backend: str | None, torch_threads: int | None, prompt: str | None = None
) -> dict:
    """Serve `model`, run the client's swap sequence against it, and return what happened."""
    import torch

    from loraswap.client import AsyncLoraswapClient
    from loraswap.server.app import start_server
    from loraswap.server.config import Settings
    from loraswap.server.engine.config import EngineConfig

    out.mkdir(parents=True, exist_ok=True)
    adapter_dir, (first, second), default_prompt = await asyncio.to_thread(_demo_adapters, model, out)
    prompt = prompt or default_prompt
    backend = compile_backend or ("inductor" if torch.cuda.is_available() else "aot_eager")
    settings = Settings(
        engine=EngineConfig(
            model=model, adapter_dir=adapter_dir, max_rank=16, compile=True, compile_backend=backend,
            torch_threads=torch_threads,
        ),
        host="127.0.0.1",
        port=0,
    )  # fmt: skip
    print(f"demo: starting {model} (compile backend {backend}) ...", file=sys.stderr, flush=True)
    running = await start_server(settings)
    runs = []
    try:
        async with AsyncLoraswapClient(f"127.0.0.1:{running.port}") as client:
            info = await client.server_info()
            print(f"demo: serving on port {running.port}: {info.family}, {len(info.target_layers)} slot layers",
                  file=sys.stderr, flush=True)  # fmt: skip
            preview_every = max(1, info.default_num_inference_steps // PREVIEWS_IN_STRIP)
            strip = None
            for adapter, scale in [("", None), (first, None), (second, None), (first, 0.5), ("", None)]:
                steps = []
                image = await client.generate_image(
                    prompt, adapter=adapter, adapter_scale=scale, seed=7, on_progress=steps.append,
                    preview_every=0 if runs else preview_every,
                )  # fmt: skip
                if not runs:
                    strip = save_preview_strip(steps, image.data, out / "previews.png")
                    print(f"demo: step previews ({len(strip['steps'])}, every {preview_every} steps) and the "
                          f"image -> {strip['image']}", file=sys.stderr, flush=True)  # fmt: skip
                label = adapter or "base"
                path = out / f"{len(runs)}-{label}{'-' + str(scale) if scale is not None else ''}.png"
                image.save(path)
                runs.append(
                    {
                        "adapter": label,
                        "scale": image.adapter_scale,
                        "image": str(path),
                        "steps_streamed": len(steps),
                        "swap_ms": round(image.timings.adapter_swap_ms, 3),
                        "load_ms": round(image.timings.adapter_load_ms, 3),
                        "total_ms": round(image.timings.total_ms, 1),
                    }
                )
                print(f"demo: {label:8s} -> {path} ({len(steps)} steps streamed)", file=sys.stderr, flush=True)
            info = await client.server_info()
    finally:
        await running.stop(5.0)
    return {
        "model": info.model,
        "prompt": prompt,
        "compiled": info.compiled,
        "compile_backend": backend,
        "runs": runs,
        "previews": strip,
        "recompilations": info.recompilations,
    }


def save_preview_strip(steps: list, image_data: bytes, path: Path) -> dict:
    """Lay the steps' previews and the final image side by side, each scaled to the image's height; save as PNG."""
    import io

    from PIL import Image

    final = Image.open(io.BytesIO(image_data)).convert("RGB")
    previews = [(event.step, Image.open(io.BytesIO(event.preview)).convert("RGB")) for event in steps if event.preview]
    height, gap = final.height, 4
    tiles = [picture.resize((round(picture.width * height / picture.height), height), Image.NEAREST)
             for _, picture in previews] + [final]  # fmt: skip
    strip = Image.new("RGB", (sum(tile.width for tile in tiles) + gap * (len(tiles) - 1), height), "white")
    left = 0
    for tile in tiles:
        strip.paste(tile, (left, 0))
        left += tile.width + gap
    strip.save(path)
    return {"image": str(path), "steps": [step for step, _ in previews]}
