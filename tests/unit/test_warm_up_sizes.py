"""warm_up_sizes: the warm-up covers every graph class a request can fall in, with sides dynamo marks dynamic.

The runtime sweeps on the tiny models (tests/integration/test_swaps.py) cannot reach SDXL's
upsampling-divisibility classes: their size multiple is a multiple of the upsampling period. The
real geometries are checked here.
"""

from __future__ import annotations

import pytest

from loraswap.server.engine.pipeline.warm_up_shapes import (
    WARM_UP_LONG_PROMPT,
    WARM_UP_PROMPT,
    token_class_sizes,
    warm_up_requests,
    warm_up_sizes,
)
from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import ModelDefaults


def _classes(sizes, period):
    """diffusers' UNet graph class of each size: (height divisible, width divisible), as the UNet checks them."""
    return {(height % period == 0, width % period == 0 if height % period == 0 else None) for width, height in sizes}


@pytest.mark.parametrize(
    ("default", "multiple", "min_size", "max_size", "period", "expected_classes"),
    [
        # SDXL base: VAE factor 8, 2 upsamplers -> period 32; requests may use any multiple of 8.
        pytest.param((1024, 1024), 8, 40, 2048, 32, {(False, None), (True, False), (True, True)}, id="sdxl"),
        pytest.param((832, 1216), 8, 40, 2048, 32, {(False, None), (True, False), (True, True)}, id="sdxl-portrait"),
        pytest.param((1024, 1024), 8, 40, 1024, 32, {(False, None), (True, False), (True, True)}, id="sdxl-at-max"),
        # random-sdxl's default and the tiny SDXL (period 4 divides the multiple: one class only).
        pytest.param((128, 128), 8, 40, 1024, 32, {(False, None), (True, False), (True, True)}, id="random-sdxl"),
        pytest.param((64, 64), 8, 8, 1024, 4, {(True, True)}, id="tiny-sdxl"),
    ],
)
def test_sdxl_sizes_cover_every_upsampling_class(default, multiple, min_size, max_size, period, expected_classes):
    sizes = warm_up_sizes(default, multiple, min_size, max_size, period)
    assert _classes(sizes, period) == expected_classes
    assert len(sizes) == len(expected_classes)
    _assert_dynamic_friendly(sizes, default, multiple, min_size, max_size)


@pytest.mark.parametrize(
    ("default", "multiple", "min_size", "max_size"),
    [((1024, 1024), 16, 32, 2048), ((1024, 1040), 16, 32, 2048), ((64, 64), 4, 8, 64), ((1024, 1024), 16, 32, 1024)],
)
def test_flux_gets_one_other_size(default, multiple, min_size, max_size):
    sizes = warm_up_sizes(default, multiple, min_size, max_size, None)
    assert len(sizes) == 1
    _assert_dynamic_friendly(sizes, default, multiple, min_size, max_size)


def _assert_dynamic_friendly(sizes, default, multiple, min_size, max_size):
    for width, height in sizes:
        assert min_size <= width <= max_size and min_size <= height <= max_size
        assert width % multiple == 0 and height % multiple == 0
        # Both sides change from the default (so both become dynamic), and stay apart from each other
        # (equal sides would share one symbol in dynamo's shape environment).
        assert width != default[0] and height != default[1] and width != height


@pytest.mark.parametrize("text_length_varies", [False, True])
def test_a_family_whose_text_follows_the_prompt_warms_up_two_prompt_lengths(text_length_varies):
    # Qwen-Image and Z-Image: the text stream is as long as the prompt, so its length must be dynamic in every graph
    # the warm-up makes: both lengths at every size and guidance. Every request the warm-up sends must be valid.
    rules = RequestRules(ModelDefaults(64, 64, 4, 4.0, 64), size_multiple=4, min_size=8, max_size=128)
    requests = warm_up_requests(rules, None, (4.0, 1.0), text_length_varies)
    assert requests[0].prompt == WARM_UP_PROMPT and requests[0].width is None
    shapes = {(request.width, request.height, request.guidance_scale, request.prompt) for request in requests[1:]}
    sizes = {(request.width, request.height) for request in requests[1:]}
    prompts = {WARM_UP_LONG_PROMPT, WARM_UP_PROMPT} if text_length_varies else {WARM_UP_PROMPT}
    assert ((64, 64) in sizes) == text_length_varies and len(sizes) == 1 + text_length_varies
    assert shapes == {(*size, guidance, prompt) for size in sizes for guidance in (4.0, 1.0) for prompt in prompts}
    assert len(requests) == 1 + len(shapes)
    for request in requests:
        rules.resolve(request)
    assert len(WARM_UP_LONG_PROMPT.split()) > 512  # past any max_sequence_length a model may have


@pytest.mark.parametrize(
    ("default", "multiple", "min_size", "max_size", "token_padding"),
    [
        pytest.param((1024, 1024), 16, 32, 2048, (16, 32), id="z-image"),
        pytest.param((64, 64), 4, 8, 128, (4, 32), id="tiny-z-image"),
        pytest.param((1024, 768), 16, 32, 1536, (16, 32), id="z-image-landscape"),
    ],
)
def test_a_model_that_pads_its_image_tokens_warms_up_a_size_of_each_remainder_class(
    default, multiple, min_size, max_size, token_padding
):
    # Z-Image pads image tokens to a multiple of 32 only where they fall short: its graphs' guards split sizes by
    # whether the token count is a multiple, so each class needs a non-default size of its own.
    sizes = token_class_sizes(default, multiple, min_size, max_size, token_padding)
    pixels, period = token_padding
    assert [(w // pixels) * (h // pixels) % period == 0 for w, h in sizes] == [True, False]
    for width, height in sizes:
        assert width != height and width not in default and height not in default
        assert width % multiple == 0 and height % multiple == 0 and min_size <= min(width, height)
        assert max(width, height) <= max_size
    rules = RequestRules(ModelDefaults(*default, 4, 4.0, 64), size_multiple=multiple, min_size=min_size,
                         max_size=max_size)  # fmt: skip
    requests = warm_up_requests(rules, None, (4.0, 0.0), True, token_padding)
    assert {(request.width, request.height) for request in requests[1:]} == {default, *sizes}
