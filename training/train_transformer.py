"""Train the `shapes` transformer and text encoders with flow matching on cached VAE latents.

Starts from untrained_shapes_components() (training/shapes_components.py) and
the VAE of train_vae.py; 10% caption dropout (empty caption, which true CFG's
empty negative prompt then matches), EMA 0.999.  Writes OUT/model, a diffusers
folder with the EMA weights.  Resumable from OUT/transformer_checkpoint.pt.

    python training/train_transformer.py --out training/runs/shapes --steps 4000
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxPipeline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraswap.server.engine.models.shapes import SHAPES_MAX_SEQUENCE_LENGTH
from training.common import (
    DEFAULT_WORK,
    TextBatcher,
    encode_pool,
    flow_matching_loss,
    log,
    save_checkpoint,
    scaled_latents,
    setup,
)
from training.shapes_components import untrained_shapes_components

TRAINED = ("transformer", "text_encoder", "text_encoder_2")


def pipeline_with(components: dict, vae, modules: dict) -> FluxPipeline:
    """A FluxPipeline over the given trained modules (copies, in eval mode)."""
    parts = {k: v for k, v in components.items() if k not in TRAINED}
    parts.update({k: copy.deepcopy(m).eval() for k, m in modules.items()})
    return FluxPipeline(vae=vae, **parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_WORK / "shapes")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--pool", type=int, default=16000)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    start = setup(args.threads)
    vae = AutoencoderKL.from_pretrained(args.out / "vae").eval()
    captions, mean, std = encode_pool(vae, "base", args.pool, args.seed, args.out / "latents_base.pt")
    log(start, f"{len(captions)} latents ready")

    components = untrained_shapes_components(args.seed)
    modules = {name: components[name].train() for name in TRAINED}
    params = [p for m in modules.values() for p in m.parameters()]
    ema = [p.detach().clone() for p in params]
    texts = TextBatcher(components["tokenizer"], components["tokenizer_2"], captions, SHAPES_MAX_SEQUENCE_LENGTH)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / 200) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))),
    )
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    step = 0
    checkpoint = args.out / "transformer_checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        for name, module in modules.items():
            module.load_state_dict(state[name])
        for e, saved in zip(ema, state["ema"], strict=True):
            e.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, rng = state["step"], state["rng"]
        generator.set_state(state["generator"])
        log(start, f"resumed at step {step}")
    log(start, f"training {sum(p.numel() for p in params) / 1e6:.2f} M parameters "
               f"(transformer {sum(p.numel() for p in modules['transformer'].parameters()) / 1e6:.2f} M)")

    def ema_modules() -> dict:
        copies = {k: copy.deepcopy(m) for k, m in modules.items()}
        for p, e in zip([p for m in copies.values() for p in m.parameters()], ema, strict=True):
            p.data.copy_(e)
        return copies

    running = None
    while step < args.steps:
        rows = rng.integers(len(captions), size=args.batch)
        batch_texts = ["" if rng.random() < args.dropout else captions[r] for r in rows]
        pooled, embeds = texts.encode(modules["text_encoder"], modules["text_encoder_2"], batch_texts)
        latents = scaled_latents(vae, mean, std, rows, generator)
        loss = flow_matching_loss(modules["transformer"], latents, pooled, embeds, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == args.steps:
            log(start, f"step {step}/{args.steps} loss {running:.4f} lr {schedule.get_last_lr()[0]:.2e}")
        if step % 250 == 0 or step == args.steps:
            save_checkpoint(checkpoint, **{k: m.state_dict() for k, m in modules.items()}, ema=ema,
                            optimizer=optimizer.state_dict(), schedule=schedule.state_dict(), step=step, rng=rng,
                            generator=generator.get_state())
        if step % args.eval_every == 0 or step == args.steps:
            from training.evaluate import score
            from training.shapes_data import prompt_set

            pipe = pipeline_with(components, vae, ema_modules())
            log(start, f"EMA at step {step}: {score(pipe, prompts=prompt_set()[::3], steps=12)} (30 prompts)")

    pipe = pipeline_with(components, vae, ema_modules())
    pipe.save_pretrained(args.out / "model", safe_serialization=True)
    log(start, f"saved {args.out / 'model'}")


if __name__ == "__main__":
    main()
