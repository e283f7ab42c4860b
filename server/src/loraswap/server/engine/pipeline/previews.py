"""Step previews: the latents after a denoising step as a small image, without a VAE decode.

Each latent pixel is projected to RGB by one linear map (LatentRgb: the family's published
factors, or a built-in model's own), on the pipeline's device, at the latent grid's resolution
(an eighth of the image's side for SDXL and Flux), shrunk there when its longer side is over
MAX_PREVIEW_SIDE; only those few pixels travel to the host to be encoded as a JPEG (the step loop
copies them without waiting and encodes them a step later: step_reads.py). A latent space with no
factors for its channel count (the random tiny models) is shown in grey.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

import torch

from loraswap.server.engine.types import GenerationParams, ImageFormat, LatentRgb

log = logging.getLogger(__name__)

MAX_PREVIEW_SIDE = 256
PREVIEW_FORMAT = ImageFormat.JPEG
PREVIEW_JPEG_QUALITY = 85


def preview_size(width: int, height: int, max_side: int = MAX_PREVIEW_SIDE) -> tuple[int, int]:
    """(width, height) shrunk, aspect ratio kept, so that the longer side is at most `max_side`."""
    longest = max(width, height)
    if longest <= max_side:
        return width, height
    return max(1, round(width * max_side / longest)), max(1, round(height * max_side / longest))


class LatentPreviewer:
    """Turns a pipeline's latents into encoded preview images. Runs on the engine's worker thread."""

    def __init__(
        self,
        projection: LatentRgb,
        latent_channels: int,
        device: torch.device,
        spatial_latents: Callable[[torch.Tensor, int, int], torch.Tensor] = lambda latents, height, width: latents,
    ) -> None:
        """`spatial_latents(latents, height, width)` gives the pipeline's latents as (batch, channels, h, w)."""
        if projection.channels != latent_channels:
            log.warning(
                "no latent-to-RGB factors for %d-channel latents (have %d); step previews are grey",
                latent_channels, projection.channels,
            )  # fmt: skip
            projection = LatentRgb.grey(latent_channels)
        self.projection = projection
        self._factors = torch.tensor(projection.factors, dtype=torch.float32, device=device)
        self._bias = torch.tensor(projection.bias, dtype=torch.float32, device=device)
        self._spatial_latents = spatial_latents

    def device_pixels(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The first image's preview as uint8 (h, w, 3), left on the latents' device; `height`/`width` are the
        image's. Nothing here waits for the device: the step loop copies the few pixels to the host a step later."""
        spatial = self._spatial_latents(latents, height, width)[0].float()  # (channels, h, w)
        rgb = torch.einsum("chw,cr->rhw", spatial, self._factors) + self._bias[:, None, None]
        size_w, size_h = preview_size(rgb.shape[2], rgb.shape[1])
        if (size_h, size_w) != tuple(rgb.shape[1:]):
            rgb = torch.nn.functional.interpolate(rgb[None], size=(size_h, size_w), mode="area")[0]
        # nan_to_num: a step whose latents overflowed still previews (the step loop then refuses it).
        rgb = torch.nan_to_num(rgb, nan=0.0).clamp(-1.0, 1.0).add(1.0).mul(127.5).round()
        return rgb.to(torch.uint8).permute(1, 2, 0)

    def pixels(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The first image's preview as uint8 (h, w, 3) on the host; `height`/`width` are the image's."""
        return self.device_pixels(latents, height, width).cpu()

    def encode(self, latents: torch.Tensor, params: GenerationParams) -> tuple[bytes, str]:
        """(the encoded preview of `latents` for a generation with `params`, its MIME type)."""
        return encode_preview(self.pixels(latents, params.height, params.width))


def encode_preview(pixels: torch.Tensor) -> tuple[bytes, str]:
    """(host pixels, uint8 (h, w, 3), as a preview file, its MIME type)."""
    from PIL import Image

    image = Image.fromarray(pixels.numpy())
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=PREVIEW_JPEG_QUALITY)
    return buffer.getvalue(), PREVIEW_FORMAT.mime_type
