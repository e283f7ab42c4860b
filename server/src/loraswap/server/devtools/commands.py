"""`loraswap make-adapter` and `loraswap export-model`: offline helpers for smoke tests and benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loraswap.server.engine.errors import StartupError
from loraswap.server.engine.models import BUILTINS

EXIT_USAGE = 2  # a bad model name or option: one line on stderr, as `loraswap serve` answers


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the make-adapter and export-model subcommands."""
    make = subparsers.add_parser("make-adapter", help="write a random LoRA (diffusers format, written by PEFT)")
    make.add_argument("--model", default="shapes", help="built-in model name or a diffusers pipeline folder")
    make.add_argument("--rank", type=int, default=8)
    make.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank)")
    make.add_argument("--target-modules", default="to_q,to_k,to_v,to_out.0", help="comma-separated layer suffixes")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--init-std", type=float, default=None, help="draw factors from N(0, std) (default: PEFT's init)")
    make.add_argument("-o", "--output", required=True, help="folder to write pytorch_lora_weights.safetensors into")
    make.set_defaults(func=run_make_adapter)

    export = subparsers.add_parser("export-model", help="write a built-in model as a diffusers pipeline folder")
    exportable = ", ".join(name for name, model in BUILTINS.items() if model.exportable)
    export.add_argument("name", help=f"built-in model name ({exportable})")
    export.add_argument("directory")
    export.set_defaults(func=run_export_model)


def refuse(command: str, error: Exception | str) -> int:
    """One line on stderr for an unusable model name or option, and the usage exit code: no traceback."""
    print(f"loraswap {command}: {error}", file=sys.stderr)
    return EXIT_USAGE


def local_model_problem(model: str) -> str | None:
    """Why `model` names no built-in model and no pipeline folder (what the offline dev commands take), or None.
    Checked before anything loads, so that no Hub lookup and no library's warnings come before the one line."""
    if model in BUILTINS or Path(model).is_dir():
        return None
    return f"unknown model {model[:200]!r}: use a built-in model ({', '.join(BUILTINS)}) or a diffusers pipeline folder"


def run_make_adapter(args: argparse.Namespace) -> int:
    problem = local_model_problem(args.model)
    if problem is not None:
        return refuse("make-adapter", problem)
    from loraswap.server.engine.quiet_imports import quiet_foreign_packages

    quiet_foreign_packages("none")  # it quantizes nothing
    import torch

    from loraswap.server.devtools.random_adapter import write_random_adapter
    from loraswap.server.engine.models import load_pipeline

    try:
        pipe = load_pipeline(args.model, torch.float32)
    except (ValueError, StartupError) as error:
        return refuse("make-adapter", error)
    targets = tuple(t.strip() for t in args.target_modules.split(",") if t.strip())
    path = write_random_adapter(
        pipe, args.output, rank=args.rank, alpha=args.alpha, target_modules=targets, seed=args.seed,
        init_std=args.init_std,
    )  # fmt: skip
    print(json.dumps({"adapter": str(path), "rank": args.rank, "target_modules": list(targets)}))
    return 0


def run_export_model(args: argparse.Namespace) -> int:
    from loraswap.server.engine.models import builtin_model

    try:
        path = builtin_model(args.name).export(args.directory)
    except ValueError as error:  # not built in, or not exported (the full-size random ones)
        return refuse("export-model", error)
    print(json.dumps({"model": args.name, "directory": str(path)}))
    return 0
