"""The GPU check: FLUX.1-dev's full-depth transformer (random weights) served the way `loraswap serve` serves it.

    python -m benchmarks.gpu_check                       # on an H100/H200: prints one JSON object
    python -m benchmarks.gpu_check --variants none,bare --requests 4
    python -m benchmarks.gpu_check --device cpu --layers 1 --size 64 --steps 2 --requests 2 --compile none  # smoke

Each variant runs in a subprocess of its own (fresh GPU memory, fresh torch.compile state), one after the other:

- `none` and `fp8`: the server's own DiffusionRuntime, made by start_runtime (the worker thread's object: slot, quantization, compile,
  warm-up) on `random-flux` with a rank-64 slot, `--quantize none` / `fp8`, `--fuse never`; two rank-64 adapters
  over the slot's layers are read by the server's loader and swapped before EVERY request, alternating, over
  `--requests` generations at `--size`² and `--steps` steps. One untimed request at that size comes first: without
  `--warm-up` (the default, to fit the time limit) it compiles the graphs of that size; the recompilations
  reported are the graphs compiled during the timed requests, swaps included, which must stay 0.
- `fused`: the same runtime with `--fuse always` (pristine copies of the slot layers' base weights kept on the
  device; only the base model's graph compiled), the same two adapters swapped before every request, each swap a
  merge into the base weights (W0 + B A, float32, one rounding): every step runs the base model's graph. The goal:
  its seconds per image within 2% of bare's plus its swap (`fused_over_bare_plus_swap` <= 1.02).
- `bare`: the same pipeline with no LoRA slot at all, compiled the same way, the same requests: the LoRA tax is
  none's seconds per image over bare's.

Every variant encodes prompts at `--max-sequence-length` T5 tokens (default 512, FLUX.1-dev's real text length;
the built-in random-flux serves 32 by default), so that seconds per image compare with published figures; the
JSON says what it ran with (`max_sequence_length`, `size`, `steps`, `layers`, the environment).

Figures per variant: seconds per image (median, wall clock around the whole generation: prompt encoding,
denoising, VAE decode and PNG encoding), swap ms (median, from the runtime's timings), recompilations, peak GPU
memory (torch.cuda.max_memory_allocated), start-up seconds (build + slot + quantize + compile + warm-up) and the
first request's seconds. The text encoders and the VAE of `random-flux` are tiny stand-ins (see
engine/models/random_full.py): the figures are the transformer's cost plus small change, not the full FLUX.1-dev
pipeline's (whose T5-XXL encode and VAE decode add roughly 0.1-0.2 s per image on an H100).

Every variant's result is also written to --out as soon as it is known, so a run stopped by a time limit keeps
what it measured. The process ends within --time-limit seconds (default 480): a variant still running then is
stopped and reported as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("none", "fp8", "bare", "fused")
# The default order: the comparisons with bare first (fused's goal, then the LoRA tax), fp8 last, since it has yet
# to finish within a device session (BENCHMARKS.md); a variant the time limit leaves no room for is reported skipped.
DEFAULT_VARIANTS = ("bare", "fused", "none", "fp8")
# FLUX.1-dev's prompt length in T5 tokens (diffusers' FluxPipeline default).
FLUX_MAX_SEQUENCE_LENGTH = 512
PROMPT = "a photo of a red fox in the snow, golden hour, 35 mm"
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated, run in this order: none, fp8, bare, fused",
    )
    parser.add_argument("--model", default="random-flux", help="built-in model (random-flux, random-sdxl, ...)")
    parser.add_argument("--layers", type=int, help="random-flux: double-stream blocks kept (default: full depth)")
    parser.add_argument("--size", type=int, default=1024, help="width and height in pixels")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps per image")
    parser.add_argument(
        "--max-sequence-length",
        type=int,
        default=FLUX_MAX_SEQUENCE_LENGTH,
        help="Flux: T5 tokens each prompt is encoded to, in every variant (FLUX.1-dev's is 512)",
    )
    parser.add_argument("--requests", type=int, default=10, help="timed requests per variant")
    parser.add_argument("--rank", type=int, default=64, help="rank of the slot and of both adapters")
    parser.add_argument("--compile", default="regional", choices=("none", "full", "regional"))
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode (--compile-mode of serve)")
    parser.add_argument("--device", default="cuda", help="torch device (cpu only for a smoke run)")
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the server's warm-up (every size class) before the first request; off by default: the check "
        "serves one size, whose graphs the untimed first request compiles, and the 8-minute budget has no room "
        "for the other classes",
    )
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds for the whole check")
    parser.add_argument("--out", type=Path, help="also write the JSON here, updated after each variant")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: run this one variant
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants takes some of {', '.join(VARIANTS)}; got {args.variants!r}")
    if args.size <= 0 or args.size % 16:
        parser.error(f"--size must be a positive multiple of 16; got {args.size}")
    if args.steps < 1 or args.requests < 1 or args.rank < 1:
        parser.error("--steps, --requests and --rank must be at least 1")
    if not 1 <= args.max_sequence_length <= FLUX_MAX_SEQUENCE_LENGTH:
        parser.error(f"--max-sequence-length must be 1 to {FLUX_MAX_SEQUENCE_LENGTH}; got {args.max_sequence_length}")
    if args.time_limit <= 0:
        parser.error("--time-limit must be positive")
    args.variant_list = variants
    return args


# -- one variant, in a child process ----------------------------------------------------------------------------


def _engine_config(args: argparse.Namespace, quantize: str, fuse: str):
    from loraswap.server.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        layers=args.layers,
        device=args.device,
        dtype="bfloat16",
        max_rank=args.rank,
        rank_buckets=(args.rank,),  # the two adapters are rank-`rank`: one bucket, one set of graphs
        compile=args.compile,
        compile_mode=args.compile_mode,
        quantize=quantize,
        fuse=fuse,
        torch_threads=None,
        warmup=args.warm_up,
    )


def _write_adapter(runtime, directory: Path, rank: int, seed: int) -> Path:
    """A rank-`rank` LoRA over every slot layer, in diffusers' file layout, with small random factors."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator("cpu").manual_seed(seed)
    tensors = {}
    for name in runtime.installed.target_layers:
        layer = runtime.denoiser.get_submodule(name).base_layer
        shape_a, shape_b = (rank, layer.in_features), (layer.out_features, rank)
        tensors[f"transformer.{name}.lora_A.weight"] = (torch.randn(shape_a, generator=generator) * 0.01).bfloat16()
        tensors[f"transformer.{name}.lora_B.weight"] = (torch.randn(shape_b, generator=generator) * 0.01).bfloat16()
    path = directory / f"adapter-{seed}.safetensors"
    save_file(tensors, path)
    return path


def _timed(generate, count: int) -> list[float]:
    seconds = []
    for index in range(count):
        started = time.perf_counter()
        generate(index)
        seconds.append(time.perf_counter() - started)
    return seconds


def _memory(device: str) -> dict:
    import torch

    if not device.startswith("cuda"):
        return {"peak_gpu_memory_gib": None}
    return {"peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 1024**3, 2)}


def _with_sequence_length(runtime, length: int):
    """The runtime, encoding prompts at `length` T5 tokens (Flux; SDXL has no such setting), and the length it runs
    with. The engine takes it from the model's defaults only (random-flux: 32), so the check rebuilds the runtime
    from its own phase records with those defaults changed."""
    from loraswap.server.engine.pipeline.runtime import DiffusionRuntime

    loaded = runtime.loaded
    if loaded.defaults.max_sequence_length is None:
        return runtime, None
    loaded = dataclasses.replace(loaded, defaults=dataclasses.replace(loaded.defaults, max_sequence_length=length))
    records = (runtime.installed, runtime.weights, runtime.compiled, runtime.warmed)
    return DiffusionRuntime(runtime.config, loaded, *records), length


def run_slot_variant(args: argparse.Namespace, quantize: str, fused: bool = False) -> dict:
    """The server's runtime with a slot: swap before every request, alternating two adapters; `fused`: each swap
    merges the adapter into the base weights (--fuse always)."""
    from loraswap.server.engine.adapters.canonical import load_canonical
    from loraswap.server.engine.adapters.sources import AdapterFile
    from loraswap.server.engine.pipeline.startup import start_runtime
    from loraswap.server.engine.types import GenerationRequest

    started = time.perf_counter()
    runtime = start_runtime(_engine_config(args, quantize, "always" if fused else "never"))
    startup_s = time.perf_counter() - started
    runtime, sequence_length = _with_sequence_length(runtime, args.max_sequence_length)
    with tempfile.TemporaryDirectory() as folder:
        adapters = []
        for seed in (1, 2):
            path = _write_adapter(runtime, Path(folder), args.rank, seed)
            adapters.append(
                load_canonical(AdapterFile(name=path.stem, path=path, source=path.name), runtime.slot_spec())
            )
    swaps_ms: list[float] = []

    def generate(index: int):
        request = GenerationRequest(
            prompt=PROMPT, width=args.size, height=args.size, num_inference_steps=args.steps, seed=index
        )
        image = runtime.generate(
            runtime.request_rules.resolve(request),
            ((adapters[index % 2], 1.0),),
            on_step=lambda progress: None,
            is_cancelled=lambda: False,
            fused=fused,
        )
        if image.fused != fused:
            raise RuntimeError(f"asked for fused={fused}, the runtime made the image with fused={image.fused}")
        swaps_ms.append(image.timings.adapter_swap_ms)
        return image

    first_s = _timed(generate, 1)[0]
    graphs_before = runtime.recompilations
    swaps_ms.clear()
    seconds = _timed(lambda index: generate(index + 1), args.requests)
    return {
        "seconds_per_image": round(statistics.median(seconds), 3),
        "seconds_per_image_all": [round(s, 3) for s in seconds],
        "swap_ms": round(statistics.median(swaps_ms), 2),
        "swaps": len(swaps_ms),
        "recompilations": runtime.recompilations - graphs_before,
        "graphs_since_ready": runtime.recompilations,  # the first request's compile counts here without --warm-up
        "startup_s": round(startup_s, 1),
        "first_request_s": round(first_s, 2),
        "denoiser_weight_gib": round(runtime.snapshot.facts.denoiser_weight_bytes / 1024**3, 2),
        "slot_layers": len(runtime.installed.target_layers),
        "fused": fused,
        "fuse_pristine_gib": round(runtime.installed.pristine_bytes / 1024**3, 2),
        "max_sequence_length": sequence_length,
        **_memory(args.device),
    }


def run_bare_variant(args: argparse.Namespace) -> dict:
    """The same pipeline without any LoRA slot, compiled the same way, the same requests."""
    import torch

    from loraswap.server.engine.families import family_of
    from loraswap.server.engine.models import generation_defaults, load_pipeline

    started = time.perf_counter()
    pipe = load_pipeline(args.model, torch.bfloat16, args.layers)
    takes_length = generation_defaults(args.model, pipe).max_sequence_length is not None
    length = {"max_sequence_length": args.max_sequence_length} if takes_length else {}
    pipe.set_progress_bar_config(disable=True)
    pipe.to(args.device)
    denoiser = family_of(pipe).denoiser(pipe)
    denoiser.requires_grad_(False)
    mode = None if args.compile_mode == "default" else args.compile_mode
    if args.compile == "full":
        denoiser.compile(mode=mode)
    elif args.compile == "regional":
        denoiser.compile_repeated_blocks(mode=mode)
    startup_s = time.perf_counter() - started

    def generate(index: int):
        with torch.inference_mode():
            return pipe(
                prompt=PROMPT,
                width=args.size,
                height=args.size,
                num_inference_steps=args.steps,
                generator=torch.Generator("cpu").manual_seed(index),
                **length,
            ).images[0]

    first_s = _timed(generate, 1)[0]
    seconds = _timed(lambda index: generate(index + 1), args.requests)
    return {
        "seconds_per_image": round(statistics.median(seconds), 3),
        "seconds_per_image_all": [round(s, 3) for s in seconds],
        "startup_s": round(startup_s, 1),
        "first_request_s": round(first_s, 2),
        "max_sequence_length": length.get("max_sequence_length"),
        **_memory(args.device),
    }


def run_variant(args: argparse.Namespace) -> dict:
    import torch

    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if args.variant == "bare":
        return run_bare_variant(args)
    if args.variant == "fused":
        return run_slot_variant(args, "none", fused=True)
    return run_slot_variant(args, args.variant)


# -- the parent: every variant in turn, within the time limit -------------------------------------------------------


def _environment(device: str) -> dict:
    import torch

    facts = {"torch": torch.__version__, "device": device}
    try:
        import diffusers

        facts["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    try:
        import torchao

        facts["torchao"] = torchao.__version__
    except ImportError:
        facts["torchao"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
        facts["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return facts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return 0
    deadline = time.monotonic() + args.time_limit
    report: dict = {
        "check": "gpu_check",
        "model": args.model,
        "layers": args.layers or "full depth",
        "size": args.size,
        "steps": args.steps,
        "max_sequence_length": args.max_sequence_length,
        "requests": args.requests,
        "rank": args.rank,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "warm_up": args.warm_up,
        "environment": _environment(args.device),
        "variants": {},
    }
    child_args = [a for a in (argv if argv is not None else sys.argv[1:])]
    for variant in args.variant_list:
        left = deadline - time.monotonic()
        if left < 20:
            report["variants"][variant] = {"skipped": "the time limit was reached before it could start"}
            continue
        # The same spelling as the parent's, in its working directory and environment: benchmarks resolves alike.
        command = [sys.executable, "-m", "benchmarks.gpu_check", *child_args, "--variant", variant]
        print(f"gpu_check: {variant} ({left:.0f} s left)", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, check=False, capture_output=True, text=True, timeout=left, env=os.environ.copy()
            )
        except subprocess.TimeoutExpired as expired:
            tail = (expired.stderr or b"")[-2000:]
            report["variants"][variant] = {
                "stopped": f"still running after {left:.0f} s, the time limit",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
            }
        else:
            lines = done.stdout.strip().splitlines()
            if done.returncode == 0 and lines:
                report["variants"][variant] = json.loads(lines[-1])
            else:
                report["variants"][variant] = {"failed": done.returncode, "stderr_tail": done.stderr[-3000:]}
        report["variants"][variant]["wall_s"] = round(time.perf_counter() - started, 1)
        _summarise(report)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def _summarise(report: dict) -> None:
    variants = report["variants"]

    def seconds(name: str) -> float | None:
        return variants.get(name, {}).get("seconds_per_image")

    if seconds("none") and seconds("bare"):
        report["lora_tax"] = round(seconds("none") / seconds("bare"), 4)
    if seconds("fp8") and seconds("none"):
        report["fp8_speedup"] = round(seconds("none") / seconds("fp8"), 3)
    if seconds("fused") and seconds("bare"):
        # The goal: a fused image costs what bare's does plus its swap (the merge), within 2%.
        swap_s = variants["fused"]["swap_ms"] / 1000.0
        report["fused_over_bare"] = round(seconds("fused") / seconds("bare"), 4)
        report["fused_over_bare_plus_swap"] = round(seconds("fused") / (seconds("bare") + swap_s), 4)
    if seconds("fused") and seconds("none"):
        report["fused_speedup_over_none"] = round(seconds("none") / seconds("fused"), 3)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "server" / "src"))
    sys.path.insert(0, str(ROOT / "client" / "src"))
    sys.exit(main())
