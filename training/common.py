"""Shared bits of the training scripts: threads, timing, checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

DEFAULT_WORK = Path(__file__).resolve().parent / "runs"


def setup(threads: int) -> float:
    """Pin torch to `threads` threads and return the start time."""
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1) if threads == 1 else None
    return time.time()


def to_tensor(images: list[np.ndarray] | np.ndarray) -> torch.Tensor:
    """uint8 NHWC pictures -> float NCHW in [-1, 1]."""
    array = np.stack(images) if isinstance(images, list) else images
    return torch.from_numpy(array).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def log(start: float, message: str) -> None:
    print(f"[{time.time() - start:7.1f}s] {message}", flush=True)


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def encode_pool(vae, style: str, count: int, seed: int, cache: Path) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Captions and VAE posterior (mean, std) of `count` training pictures in `style`; cached in `cache`."""
    from training.shapes_data import training_example

    if cache.exists():
        state = torch.load(cache, weights_only=False)
        if state["count"] == count and state["seed"] == seed and state["style"] == style:
            return state["captions"], state["mean"], state["std"]
    rng = np.random.default_rng(seed)
    captions, means, stds = [], [], []
    with torch.no_grad():
        for first in range(0, count, 256):
            examples = [training_example(rng, style) for _ in range(min(256, count - first))]
            captions += [text for text, _ in examples]
            posterior = vae.encode(to_tensor([image for _, image in examples])).latent_dist
            means.append(posterior.mean)
            stds.append(posterior.std)
    mean, std = torch.cat(means), torch.cat(stds)
    save_checkpoint(cache, captions=captions, mean=mean, std=std, count=count, seed=seed, style=style)
    return captions, mean, std


class TextBatcher:
    """Token ids of every caption, made once, fed to the text encoders as FluxPipeline does."""

    def __init__(self, tokenizer, tokenizer_2, captions, max_sequence_length: int) -> None:
        texts = sorted(set(captions) | {""})
        self.index = {text: i for i, text in enumerate(texts)}
        self.clip_ids = tokenizer(
            texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids
        self.t5_ids = tokenizer_2(
            texts, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids

    def encode(self, text_encoder, text_encoder_2, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.tensor([self.index[t] for t in texts])
        pooled = text_encoder(self.clip_ids[rows], output_hidden_states=False).pooler_output
        embeds = text_encoder_2(self.t5_ids[rows], output_hidden_states=False)[0]
        return pooled, embeds


def flow_matching_loss(transformer, latents, pooled, embeds, generator: torch.Generator) -> torch.Tensor:
    """The loss of diffusers' train_dreambooth_lora_flux.py: uniform sigma, predict noise - latents."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    noise = torch.randn(latents.shape, generator=generator)
    sigmas = torch.rand(b, generator=generator)
    noisy = (1 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
    packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
    txt_ids = torch.zeros(embeds.shape[1], 3)
    prediction = transformer(
        hidden_states=packed, timestep=sigmas, guidance=None, pooled_projections=pooled,
        encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
    )[0]
    prediction = FluxPipeline._unpack_latents(prediction, h * 4, w * 4, 4)
    return torch.nn.functional.mse_loss(prediction, noise - latents)


def scaled_latents(vae, mean: torch.Tensor, std: torch.Tensor, rows, generator: torch.Generator) -> torch.Tensor:
    """Posterior samples for `rows`, shifted and scaled as FluxPipeline expects."""
    sample = mean[rows] + std[rows] * torch.randn(mean[rows].shape, generator=generator)
    return (sample - vae.config.shift_factor) * vae.config.scaling_factor
