"""Fit the `shapes` model's latent-to-RGB preview factors by least squares against its own VAE.

Step previews (Progress.preview) project each latent pixel to RGB with one linear map
instead of a VAE decode. SDXL and Flux have published factors; the `shapes` VAE is its own,
so its factors are fitted here: pictures of the kind the model draws (every style the demo
adapters restyle to) are encoded with the shipped VAE, the latents scaled and shifted as the
pipeline denoises them, decoded back, and the decoded pictures averaged down to the latent
grid; then [latent, 1] @ W ~ rgb in [-1, 1] is solved for W ([channels + 1, 3]: the factors
and the bias). The result is recorded as SHAPES_LATENT_RGB in
server/src/loraswap/server/engine/models/shapes.py; tests/unit/test_previews.py reruns the fit
and compares. Deterministic (seeded pictures, float64 solve); a few seconds on one core.

    python training/shapes_latent_rgb.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.common import setup, to_tensor
from training.shapes_data import ADAPTER_STYLES, render, restyle, sample_scene

DEFAULT_PICTURES = 48
DEFAULT_SEED = 7
DECIMALS = 4


def fit_latent_rgb(
    pictures: int = DEFAULT_PICTURES, seed: int = DEFAULT_SEED
) -> tuple[tuple[tuple[float, float, float], ...], tuple[float, float, float]]:
    """(factors, bias) rounded to DECIMALS places: rgb ~ latent @ factors + bias, for the shipped shapes VAE."""
    from diffusers import AutoencoderKL

    from loraswap.server.engine.models.shapes import shapes_weights_dir

    vae = AutoencoderKL.from_pretrained(shapes_weights_dir() / "vae", torch_dtype=torch.float32).eval()
    rng = np.random.default_rng(seed)
    styles = ("base",) + ADAPTER_STYLES
    images = to_tensor([render(restyle(sample_scene(rng), styles[i % len(styles)])) for i in range(pictures)])
    config = vae.config
    factor = 2 ** (len(config.block_out_channels) - 1)
    with torch.no_grad():
        raw = vae.encode(images).latent_dist.mean
        decoded = vae.decode(raw).sample.clamp(-1, 1)
    # The pipeline denoises (raw - shift) * scale and decodes latents / scale + shift.
    latents = (raw - config.shift_factor) * config.scaling_factor
    targets = torch.nn.functional.avg_pool2d(decoded, factor)
    x = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1]).double()
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    y = targets.permute(0, 2, 3, 1).reshape(-1, 3).double()
    solution = torch.linalg.lstsq(x, y).solution.numpy()
    rows = [tuple(round(float(value), DECIMALS) for value in row) for row in solution]
    return tuple(rows[:-1]), rows[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pictures", type=int, default=DEFAULT_PICTURES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup(args.threads)
    factors, bias = fit_latent_rgb(args.pictures, args.seed)
    print("SHAPES_LATENT_RGB = LatentRgb(")
    print("    factors=(")
    for row in factors:
        print(f"        {row},")
    print("    ),")
    print(f"    bias={bias},")
    print(")")


if __name__ == "__main__":
    main()
