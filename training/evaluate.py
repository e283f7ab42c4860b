"""Score a `shapes`-style model folder (optionally with one LoRA adapter) on the prompt set; prints JSON.

Each prompt is drawn once (seed = its index + --seed) and read by the pixel
classifier (training.shapes_classifier).  What counts as right depends
on --style, i.e. what the adapter is meant to do:

    base         shape, color and background as the caption says, filled
    outline      the same, drawn hollow
    swap-colors  shape color and background color exchanged
    purple       a purple shape on the caption's background

    python training/evaluate.py server/src/loraswap/server/engine/models/shapes_weights
    python training/evaluate.py MODEL --adapter .../adapters/outline --style outline
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.shapes_classifier import ShapeReading, classify_image
from training.shapes_data import Prompt, Scene, prompt_set, restyle

STYLES = ("base", "outline", "swap-colors", "purple")


def expected(prompt: Prompt, style: str) -> Scene:
    """The scene an adapter of `style` should draw for the prompt."""
    return restyle(Scene(prompt.shape, prompt.color, prompt.background, 32, 32, 40), style)


def judge(reading: ShapeReading, prompt: Prompt, style: str) -> dict[str, bool]:
    """Per-criterion verdicts for one picture."""
    want = expected(prompt, style)
    return dict(
        shape=reading.shape == want.shape,
        color=reading.color == want.color,
        background=reading.background == want.background,
        hollow=reading.hollow == (want.outline > 0),
    )


def summarize(verdicts: list[dict[str, bool]]) -> dict[str, float]:
    """Share of pictures right on each criterion and on all of them together."""
    keys = verdicts[0].keys()
    out = {key: float(np.mean([v[key] for v in verdicts])) for key in keys}
    out["all"] = float(np.mean([all(v.values()) for v in verdicts]))
    return out


@torch.no_grad()
def draw(pipe, prompts: Sequence[str], *, seed: int, steps: int, true_cfg: float, batch: int = 45) -> list[np.ndarray]:
    """Draw each prompt once with FluxPipeline (seed + index), true CFG against an empty negative prompt."""
    pipe.set_progress_bar_config(disable=True)
    images = []
    for first in range(0, len(prompts), batch):
        chunk = list(prompts[first : first + batch])
        generators = [torch.Generator().manual_seed(seed + first + i) for i in range(len(chunk))]
        out = pipe(
            prompt=chunk,
            negative_prompt=[""] * len(chunk),
            true_cfg_scale=true_cfg,
            height=64,
            width=64,
            num_inference_steps=steps,
            max_sequence_length=16,
            generator=generators,
            output_type="np",
        ).images
        images.extend((np.clip(out, 0, 1) * 255).round().astype(np.uint8))
    return images


def score(pipe, style: str = "base", *, seed: int = 0, steps: int = 20, true_cfg: float = 3.0,
          prompts: Sequence[Prompt] | None = None) -> dict[str, float]:
    """Accuracy of the pipeline (with whatever adapter is loaded) on the prompt set for `style`."""
    prompts = list(prompts or prompt_set())
    images = draw(pipe, [p.text for p in prompts], seed=seed, steps=steps, true_cfg=true_cfg)
    return summarize([judge(classify_image(img), p, style) for img, p in zip(images, prompts, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--adapter", type=Path, help="folder with pytorch_lora_weights.safetensors")
    parser.add_argument("--style", choices=STYLES, help="what the adapter does (default: its folder name, or base)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--true-cfg", type=float, default=3.0)
    parser.add_argument("--shift", type=float, help="override the scheduler's shift")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save-grid", type=Path, help="write the pictures as one PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)
    if args.shift is not None:
        pipe.scheduler.register_to_config(shift=args.shift)
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    style = args.style or (args.adapter.name if args.adapter and args.adapter.name in STYLES else "base")
    if args.adapter:
        pipe.load_lora_weights(args.adapter, adapter_name="scored")
        pipe.set_adapters(["scored"], [args.scale])
    prompts = prompt_set()
    images = draw(pipe, [p.text for p in prompts], seed=args.seed, steps=args.steps, true_cfg=args.true_cfg)
    verdicts = [judge(classify_image(img), p, style) for img, p in zip(images, prompts, strict=True)]
    if args.save_grid:
        from PIL import Image

        rows = [np.concatenate(images[i : i + 15], 1) for i in range(0, len(images), 15)]
        Image.fromarray(np.concatenate(rows, 0)).save(args.save_grid)
    result = dict(
        model=str(args.model), adapter=str(args.adapter) if args.adapter else None, style=style, scale=args.scale,
        steps=args.steps, true_cfg_scale=args.true_cfg, prompts=len(prompts), **summarize(verdicts),
        seconds=round(time.time() - start, 1),
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
