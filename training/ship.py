"""Copy a trained model and its adapters into the package (server/src/loraswap/server/engine/models/shapes_weights).

Weights are stored as bfloat16 (the engine loads them back as float32); the
README records that this changed no score.  --shift sets the scheduler's shift.

    python training/ship.py --out training/runs/shapes
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from diffusers import FluxPipeline
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraswap.server.engine.models.shapes import shapes_adapter_dir, shapes_weights_dir
from training.common import DEFAULT_WORK
from training.shapes_data import ADAPTER_STYLES

WEIGHTS_FILE = "pytorch_lora_weights.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_WORK / "shapes")
    parser.add_argument("--dest", type=Path, default=shapes_weights_dir())
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--shift", type=float, help="scheduler shift to ship (default: keep the trained config)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    pipe = FluxPipeline.from_pretrained(args.out / "model", dtype=torch.float32)
    if args.shift is not None:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=args.shift)
    pipe.to(dtype=dtype)
    if args.dest.exists():
        shutil.rmtree(args.dest)
    pipe.save_pretrained(args.dest, safe_serialization=True)
    adapters = args.dest / shapes_adapter_dir().name
    for style in ADAPTER_STYLES:
        source = args.out / "adapters" / style / WEIGHTS_FILE
        with safe_open(source, "pt") as f:
            metadata = f.metadata()
            tensors = {key: f.get_tensor(key).to(dtype).contiguous() for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        (adapters / style).mkdir(parents=True)
        save_file(tensors, adapters / style / WEIGHTS_FILE, metadata=metadata)
    files = [p for p in args.dest.rglob("*") if p.is_file()]
    print(f"{args.dest}: {len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
