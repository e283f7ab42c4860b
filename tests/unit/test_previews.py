"""Step previews: the latent-to-RGB projection, Flux's unpacking, the sizes, which steps carry one, the rules.

The projection is checked against the factors themselves (a one-hot latent pixel is its
channel's row plus the bias); the `shapes` model's own factors against a rerun of their
fit (training/shapes_latent_rgb.py) and against its final images: the last preview's
dominant colours are the image's, and the same check fails for shuffled factors.
"""

from __future__ import annotations

import io
import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline, FluxPipeline, QwenImagePipeline
from PIL import Image

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import InvalidRequestError
from loraswap.server.engine.families import FLUX, FLUX2, FLUX_LATENT_RGB, QWEN_IMAGE, SDXL, SDXL_LATENT_RGB, Z_IMAGE
from loraswap.server.engine.models import BUILTINS, latent_rgb
from loraswap.server.engine.models.shapes import SHAPES_LATENT_RGB
from loraswap.server.engine.pipeline.previews import MAX_PREVIEW_SIDE, LatentPreviewer, preview_size
from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import GenerationRequest, LatentRgb, ModelDefaults
from tests.support.previews import dominant_colours_agree
from tests.support.servers import TEST_TORCH_THREADS

CPU = torch.device("cpu")


def expected_pixel(projection: LatentRgb, channel: int, value: float = 1.0) -> np.ndarray:
    rgb = np.array(projection.factors[channel]) * value + np.array(projection.bias)
    return np.round((np.clip(rgb, -1, 1) + 1) * 127.5)


@pytest.mark.parametrize(
    "projection",
    [SDXL_LATENT_RGB, FLUX_LATENT_RGB, QWEN_IMAGE.latent_rgb, FLUX2.latent_rgb, SHAPES_LATENT_RGB],
    ids=["sdxl", "flux", "qwen-image", "flux2", "shapes"],
)
def test_a_one_hot_latent_pixel_is_its_channels_factors_plus_the_bias(projection: LatentRgb) -> None:
    channels = projection.channels
    latents = torch.zeros(1, channels, 1, channels)
    for channel in range(channels):
        latents[0, channel, 0, channel] = 1.0  # latent pixel (0, c): channel c alone
    pixels = LatentPreviewer(projection, channels, CPU).pixels(latents, 8, 8 * channels).numpy()

    assert pixels.shape == (1, channels, 3) and pixels.dtype == np.uint8
    for channel in range(channels):
        np.testing.assert_allclose(pixels[0, channel], expected_pixel(projection, channel), atol=1)


def test_the_families_carry_the_published_factors() -> None:
    assert (SDXL.latent_rgb.channels, FLUX.latent_rgb.channels) == (4, 16)
    assert SDXL.latent_rgb.factors[0] == (0.3651, 0.4232, 0.4341) and SDXL.latent_rgb.bias == (0.1084, -0.0175, -0.0011)
    assert FLUX.latent_rgb.factors[-1] == (-0.1262, -0.0982, -0.0778)
    assert FLUX.latent_rgb.bias == (-0.0329, -0.0718, -0.0851)
    # Qwen-Image keeps Wan 2.1's VAE latent space; FLUX.2's VAE has 32 channels; Z-Image uses FLUX.1's VAE.
    assert (QWEN_IMAGE.latent_rgb.channels, FLUX2.latent_rgb.channels) == (16, 32)
    assert QWEN_IMAGE.latent_rgb.factors[0] == (-0.1299, -0.1692, 0.2932)
    assert QWEN_IMAGE.latent_rgb.bias == (-0.1835, -0.0868, -0.3360)
    assert FLUX2.latent_rgb.factors[3] == (0.2144, 0.3009, 0.3652) and FLUX2.latent_rgb.factors[-1][-1] == -0.0614
    assert Z_IMAGE.latent_rgb == FLUX_LATENT_RGB


def test_a_builtin_with_its_own_vae_brings_its_own_factors_others_their_familys() -> None:
    assert BUILTINS["shapes"].latent_rgb == SHAPES_LATENT_RGB
    flux_pipe = FluxPipeline(**dict.fromkeys(("scheduler", "vae", "text_encoder", "tokenizer"), None),
                             text_encoder_2=None, tokenizer_2=None, transformer=None)  # fmt: skip
    assert latent_rgb("shapes", flux_pipe) == SHAPES_LATENT_RGB
    assert latent_rgb("random-flux", flux_pipe) == FLUX_LATENT_RGB
    assert latent_rgb("/some/flux/folder", flux_pipe) == FLUX_LATENT_RGB


def test_flux_packed_latents_are_unpacked_before_the_projection() -> None:
    generator = torch.Generator().manual_seed(0)
    spatial = torch.randn(1, 16, 6, 10, generator=generator)  # a 48x80 image's latents (VAE factor 8)
    packed = FluxPipeline._pack_latents(spatial, 1, 16, 6, 10)
    assert packed.shape == (1, 15, 64)
    pipe = SimpleNamespace(_unpack_latents=FluxPipeline._unpack_latents, vae_scale_factor=8)
    unpacking = LatentPreviewer(
        FLUX_LATENT_RGB, 16, CPU, lambda latents, h, w: FLUX.spatial_latents(pipe, latents, h, w)
    )
    direct = LatentPreviewer(FLUX_LATENT_RGB, 16, CPU)

    from_packed = unpacking.pixels(packed, 48, 80)
    assert from_packed.shape == (6, 10, 3)
    assert torch.equal(from_packed, direct.pixels(spatial, 48, 80))
    # Not the same picture when read without unpacking: the test would notice a wrong unpack.
    assert not torch.equal(from_packed, direct.pixels(spatial.flip(-1), 48, 80))


# How each newer family's pipeline turns a 48x80 image's VAE latents (channels, 6, 10) into what its loop holds:
# Qwen-Image packs 2x2 patches into tokens; FLUX.2 patchifies 2x2 into 128 channels, then a token per patch.
PACKERS = {
    "qwen-image": (QWEN_IMAGE, 16, lambda spatial: QwenImagePipeline._pack_latents(spatial, 1, 16, 6, 10),
                   SimpleNamespace(_unpack_latents=QwenImagePipeline._unpack_latents, vae_scale_factor=8)),
    "flux2": (FLUX2, 32, lambda spatial: Flux2Pipeline._pack_latents(Flux2Pipeline._patchify_latents(spatial)),
              SimpleNamespace(_unpatchify_latents=Flux2Pipeline._unpatchify_latents, vae_scale_factor=8)),
}  # fmt: skip


@pytest.mark.parametrize("family", list(PACKERS))
def test_the_newer_families_loop_latents_become_the_vaes_channels_before_the_projection(family: str) -> None:
    # The factors are the VAE's channels' (ComfyUI un-patchifies FLUX.2's 128 channels the same way before them).
    traits, channels, pack, pipe = PACKERS[family]
    spatial = torch.randn(1, channels, 6, 10, generator=torch.Generator().manual_seed(1))
    packed = pack(spatial)
    assert packed.shape == (1, 15, channels * 4)
    projection = traits.latent_rgb
    unpacking = LatentPreviewer(
        projection, channels, CPU, lambda latents, h, w: traits.spatial_latents(pipe, latents, h, w)
    )
    direct = LatentPreviewer(projection, channels, CPU)

    from_packed = unpacking.pixels(packed, 48, 80)
    assert from_packed.shape == (6, 10, 3)
    assert torch.equal(from_packed, direct.pixels(spatial, 48, 80))
    assert not torch.equal(from_packed, direct.pixels(spatial.flip(-1), 48, 80))


@pytest.mark.parametrize(
    ("size", "expected"),
    [((16, 16), (16, 16)), ((128, 96), (128, 96)), ((256, 32), (256, 32)), ((300, 150), (256, 128)),
     ((150, 600), (64, 256)), ((1000, 3), (256, 1))],
)  # fmt: skip
def test_preview_size_keeps_the_aspect_ratio_within_the_longest_side(size, expected) -> None:
    assert preview_size(*size) == expected
    assert max(preview_size(*size)) <= MAX_PREVIEW_SIDE


def test_latents_larger_than_the_limit_are_shrunk_on_the_device() -> None:
    latents = torch.randn(1, 4, 150, 300)  # (h, w): a 2400x1200 SDXL image
    pixels = LatentPreviewer(SDXL_LATENT_RGB, 4, CPU).pixels(latents, 1200, 2400)
    assert pixels.shape == (128, 256, 3)


def test_a_latent_space_without_factors_previews_in_grey(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        previewer = LatentPreviewer(FLUX_LATENT_RGB, 4, CPU)  # tiny-flux: a 4-channel VAE in a Flux pipeline
    assert "grey" in caplog.text
    assert previewer.projection == LatentRgb.grey(4)
    pixels = previewer.pixels(torch.randn(1, 4, 5, 7), 40, 56).numpy()
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()


def test_previews_encode_as_jpeg_with_the_latents_shape() -> None:
    rules = RequestRules(ModelDefaults(64, 64, 4, 5.0), size_multiple=8, min_size=16, max_size=2048)
    params = rules.resolve(GenerationRequest(prompt="p", width=96, height=64, preview_every=1, seed=0))
    data, mime = LatentPreviewer(SDXL_LATENT_RGB, 4, CPU).encode(torch.randn(1, 4, 8, 12), params)
    assert mime == "image/jpeg"
    assert Image.open(io.BytesIO(data)).size == (12, 8)


RULES = RequestRules(ModelDefaults(64, 64, 20, 1.0), size_multiple=8, min_size=16, max_size=2048)


@pytest.mark.parametrize(
    ("every", "steps", "expected"),
    [(0, 20, []), (1, 3, [1, 2, 3]), (5, 20, [5, 10, 15, 20]), (7, 20, [7, 14, 20]), (20, 20, [20]),
     (100, 20, [20]), (2**32 - 1, 4, [4])],
)  # fmt: skip
def test_previews_come_every_n_steps_and_at_the_last(every: int, steps: int, expected: list[int]) -> None:
    params = RULES.resolve(GenerationRequest(prompt="p", num_inference_steps=steps, preview_every=every))
    assert params.preview_every == every
    assert [step for step in range(1, steps + 1) if params.wants_preview(step)] == expected


def test_a_negative_preview_every_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="preview_every is -1") as raised:
        RULES.resolve(GenerationRequest(prompt="p", preview_every=-1))
    assert raised.value.metadata["field"] == "preview_every"


def test_the_shapes_factors_are_what_the_training_script_fits() -> None:
    from training.shapes_latent_rgb import fit_latent_rgb

    torch.set_num_threads(TEST_TORCH_THREADS)
    factors, bias = fit_latent_rgb()
    np.testing.assert_allclose(np.array(factors), np.array(SHAPES_LATENT_RGB.factors), atol=2e-4)
    np.testing.assert_allclose(np.array(bias), np.array(SHAPES_LATENT_RGB.bias), atol=2e-4)


# --------------------------------------------------------------------------- the shapes model's own images

SHAPES_PROMPTS = (
    "a red circle on a blue background",
    "a green triangle on a yellow background",
    "a white square on a black background",
)


@pytest.fixture(scope="module")
def shapes_runtime():
    from loraswap.server.engine.pipeline.startup import start_runtime

    return start_runtime(
        EngineConfig(model="shapes", device="cpu", compile=False, warmup=False, torch_threads=TEST_TORCH_THREADS)
    )


def last_preview_and_image(runtime, prompt: str, previewer: LatentPreviewer) -> tuple[bytes, bytes]:
    """The last step's preview made by `previewer`, and the image, of one base-model run of the runtime's pipeline."""
    from loraswap.server.engine.pipeline.image_encoding import encode_image
    from loraswap.server.engine.pipeline.runner import PipelineRunner

    runner = PipelineRunner(replace(runtime.loaded, previewer=previewer), runtime.compiled)
    events = []
    params = runtime.request_rules.resolve(GenerationRequest(prompt=prompt, seed=3, preview_every=1000))
    with runner.session():
        run = runner.run(params, on_step=events.append, is_cancelled=lambda: False)
    assert [event.step for event in events if event.preview] == [params.num_inference_steps]
    return events[-1].preview, encode_image(run.pixels, params.image_format)


def test_the_last_shapes_preview_has_the_images_dominant_colours_and_shuffled_factors_do_not(shapes_runtime) -> None:
    fitted = shapes_runtime.loaded.previewer
    shuffled = LatentRgb(SHAPES_LATENT_RGB.factors[1:] + SHAPES_LATENT_RGB.factors[:1], SHAPES_LATENT_RGB.bias)
    wrong = LatentPreviewer(shuffled, 4, CPU, fitted._spatial_latents)
    for prompt in SHAPES_PROMPTS:
        agree, detail = dominant_colours_agree(*last_preview_and_image(shapes_runtime, prompt, fitted))
        assert agree, f"{prompt}: {detail}"
        agree, detail = dominant_colours_agree(*last_preview_and_image(shapes_runtime, prompt, wrong))
        assert not agree, f"{prompt}: shuffled factors passed the check: {detail}"


def test_projection_is_not_just_any_linear_map(shapes_runtime) -> None:
    """Swapping the output colours (RGB -> BGR) fails the check too, on a prompt whose colours it changes."""
    fitted = shapes_runtime.loaded.previewer
    bgr = replace(
        SHAPES_LATENT_RGB,
        factors=tuple(row[::-1] for row in SHAPES_LATENT_RGB.factors),
        bias=SHAPES_LATENT_RGB.bias[::-1],
    )
    preview, image = last_preview_and_image(
        shapes_runtime, SHAPES_PROMPTS[0], LatentPreviewer(bgr, 4, CPU, fitted._spatial_latents)
    )
    assert not dominant_colours_agree(preview, image)[0]
