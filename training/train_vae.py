"""Train the `shapes` VAE (AutoencoderKL, 4x downsampling, 4 latent channels) on synthetic pictures.

The VAE sees every palette color (including the ones only adapters draw) and
hollow shapes with 2-5 px lines from the start, so adapters never need a color
or a line the decoder cannot draw.  Writes OUT/vae (diffusers folder) with
shift_factor/scaling_factor measured from the latents.  Resumable: rerunning
continues from OUT/vae_checkpoint.pt.

    python training/train_vae.py --out training/runs/shapes --steps 1300
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.common import DEFAULT_WORK, log, save_checkpoint, setup, to_tensor
from training.shapes_data import ADAPTER_STYLES, render, restyle, sample_scene, vae_scene

VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(32, 64, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=16,
    sample_size=64,
    use_quant_conv=False,
    use_post_quant_conv=False,
    # Purely convolutional, so training on crops teaches the same network that decodes full pictures.
    mid_block_add_attention=False,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_WORK / "shapes")
    parser.add_argument("--steps", type=int, default=1300)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--crop", type=int, default=32, help="train on random crops this big (4x cheaper at 32)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pool", type=int, default=12000, help="distinct training pictures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    start = setup(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    pool = np.stack([render(vae_scene(rng)) for _ in range(args.pool)])
    log(start, f"{len(pool)} pictures drawn")

    torch.manual_seed(args.seed)
    vae = AutoencoderKL(**VAE_CONFIG)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    checkpoint = args.out / "vae_checkpoint.pt"
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        vae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = state["step"]
        rng = state["rng"]
        log(start, f"resumed at step {step}")
    log(start, f"VAE {sum(p.numel() for p in vae.parameters()) / 1e6:.2f} M parameters")
    vae.train()
    running = 0.0
    while step < args.steps:
        y, x = rng.integers(0, 64 - args.crop + 1, size=2) // 4 * 4
        batch = to_tensor(pool[rng.integers(len(pool), size=args.batch), y : y + args.crop, x : x + args.crop])
        posterior = vae.encode(batch).latent_dist
        decoded = vae.decode(posterior.sample()).sample
        kl = posterior.kl().mean() / batch[0].numel()
        loss = torch.nn.functional.mse_loss(decoded, batch) + (decoded - batch).abs().mean() + 1e-6 * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        running = 0.98 * running + 0.02 * loss.item() if step > 1 else loss.item()
        if step % 50 == 0 or step == args.steps:
            log(start, f"step {step}/{args.steps} loss {running:.4f}")
        if step % 200 == 0 or step == args.steps:
            save_checkpoint(checkpoint, model=vae.state_dict(), optimizer=optimizer.state_dict(),
                            schedule=schedule.state_dict(), step=step, rng=rng)

    vae.eval()
    # Latent statistics over the pictures the transformer and the adapters will see.
    stats_rng = np.random.default_rng(args.seed + 1)
    styles = ("base",) + ADAPTER_STYLES
    pictures = [render(restyle(sample_scene(stats_rng), styles[i % len(styles)])) for i in range(1024)]
    with torch.no_grad():
        latents = torch.cat([vae.encode(to_tensor(pictures[i : i + 128])).latent_dist.mean for i in range(0, 1024, 128)])
        shift, scale = latents.mean().item(), 1.0 / latents.std().item()
        error = (vae.decode(latents[:256]).sample.clamp(-1, 1) - to_tensor(pictures[:256])).abs().mean().item() * 127.5
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    vae.save_pretrained(args.out / "vae", safe_serialization=True)
    log(start, f"saved {args.out / 'vae'}: shift_factor {shift:.4f} scaling_factor {scale:.4f}, "
               f"mean abs reconstruction error {error:.2f}/255")


if __name__ == "__main__":
    main()
