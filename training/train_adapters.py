"""Train the `shapes` demo adapters: rank-16 LoRAs on the transformer, same captions, restyled pictures.

    outline      shapes drawn hollow (4 px lines)
    swap-colors  shape and background colors exchanged
    purple       shapes in purple, a color the base model never draws (the VAE learnt it)

No trigger word: each adapter sees the base model's own captions.  Writes
OUT/adapters/<name>/pytorch_lora_weights.safetensors (diffusers format, with
PEFT metadata).  Text encoders, VAE and base transformer stay frozen.

    python training/train_adapters.py --out training/runs/shapes
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loraswap.server.engine.models.shapes import SHAPES_MAX_SEQUENCE_LENGTH
from training.common import (
    DEFAULT_WORK,
    TextBatcher,
    encode_pool,
    flow_matching_loss,
    log,
    scaled_latents,
    setup,
)
from training.shapes_data import ADAPTER_STYLES

# Every layer the server's swap slot covers, inside the blocks (not the model's final proj_out).
TARGET_MODULES = (
    r".*blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)|proj_mlp|proj_out)"
)
ADAPTER = "style"
# (steps, learning rate) per style: thin hollow outlines take longest to learn.
SCHEDULES = {"outline": (1500, 1.5e-3), "swap-colors": (600, 1e-3), "purple": (600, 1e-3)}


def train_one(pipe: FluxPipeline, style: str, args, start: float) -> dict:
    """Train, save and score the adapter for one style; the model is left without adapters."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    seed = args.seed + 1 + ADAPTER_STYLES.index(style)
    steps = args.steps or SCHEDULES[style][0]
    lr = args.lr or SCHEDULES[style][1]
    captions, mean, std = encode_pool(pipe.vae, style, args.pool, seed, args.out / f"latents_{style}.pt")
    texts = TextBatcher(pipe.tokenizer, pipe.tokenizer_2, captions, SHAPES_MAX_SEQUENCE_LENGTH)
    with torch.no_grad():
        # Frozen text encoders: every caption's embeddings once.
        all_texts = sorted(texts.index, key=texts.index.get)
        pooled_all, embeds_all = texts.encode(pipe.text_encoder, pipe.text_encoder_2, all_texts)
    transformer = pipe.transformer
    config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGET_MODULES, init_lora_weights="gaussian")
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name=ADAPTER)
    transformer.set_adapters(ADAPTER)
    transformer.train()
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for n, p in transformer.named_parameters():
        p.requires_grad_("lora_" in n)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    running = None
    for step in range(1, steps + 1):
        rows = rng.integers(len(captions), size=args.batch)
        ids = torch.tensor([texts.index["" if rng.random() < args.dropout else captions[r]] for r in rows])
        latents = scaled_latents(pipe.vae, mean, std, rows, generator)
        loss = flow_matching_loss(transformer, latents, pooled_all[ids], embeds_all[ids], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        running = loss.item() if running is None else 0.97 * running + 0.03 * loss.item()
        if step % 100 == 0 or step == steps:
            log(start, f"{style}: step {step}/{steps} loss {running:.4f}")
    transformer.eval()
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(transformer, adapter_name=ADAPTER).items()}
    directory = args.out / "adapters" / style
    FluxPipeline.save_lora_weights(
        directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict()
    )
    from training.evaluate import score

    result = score(pipe, style, steps=20, prompts=None)
    transformer.delete_adapters(ADAPTER)
    for p in transformer.parameters():
        p.requires_grad_(False)
    log(start, f"{style}: saved {directory}; 90 prompts: {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_WORK / "shapes")
    parser.add_argument("--model", type=Path, help="base model folder (default OUT/model)")
    parser.add_argument("--styles", nargs="+", default=list(ADAPTER_STYLES), choices=ADAPTER_STYLES)
    parser.add_argument("--steps", type=int, help="default: per style, see SCHEDULES")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, help="default: per style, see SCHEDULES")
    parser.add_argument("--pool", type=int, default=6000)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    start = setup(args.threads)
    pipe = FluxPipeline.from_pretrained(args.model or args.out / "model", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.transformer):
        module.requires_grad_(False).eval()
    for style in args.styles:
        if (args.out / "adapters" / style / "pytorch_lora_weights.safetensors").exists():
            log(start, f"{style}: already trained, skipping (delete the folder to retrain)")
            continue
        train_one(pipe, style, args, start)
    log(start, "done")


if __name__ == "__main__":
    main()
