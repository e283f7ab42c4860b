"""The warm-up: the requests that make every later request reuse a compiled graph.

dynamo compiles the first call for its exact shapes; a call with other shapes marks the
changed dimensions dynamic. Past that, guards split requests into classes that each need
a graph (see `warm_up_sizes`), and some guidance settings change a batch dimension (see
`FamilyTraits.warm_up_guidance`). And dynamo specialises on the swap slot's rank bucket, so a
compiled server runs the requests once per bucket (see `warm_up_buckets`). Plain values in,
plain requests out: no torch here.
"""

from __future__ import annotations

from loraswap.server.engine.request_rules import RequestRules
from loraswap.server.engine.types import GenerationRequest

WARM_UP_PROMPT = "warm-up"
# For families whose text stream is as long as the prompt: the requests beyond the first use this one, which
# fills any max_sequence_length up to 512 tokens (and so crosses Z-Image's padding to multiples of 32), so the
# text's length changes with the size and is marked dynamic with it.
WARM_UP_LONG_PROMPT = " ".join(["a long warm-up prompt of many words"] * 80)
WARM_UP_STEPS = 2


def warm_up_sizes(
    default: tuple[int, int], multiple: int, min_size: int, max_size: int, upsample_period: int | None
) -> list[tuple[int, int]]:
    """The (width, height) sizes, besides the default, that a warm-up runs so no allowed size compiles later.

    Each size differs from the default in both sides, and its width from its height, so dynamo
    marks both sides dynamic without tying them together. `upsample_period` (SDXL only: the VAE
    factor times 2**num_upsamplers, in pixels) splits sizes into three graph classes, because
    diffusers' UNet passes explicit upsample sizes when the latent's height or width is not a
    multiple of 2**num_upsamplers (`if dim % default_overall_up_factor != 0`, checking height
    first, then `break`): height not divisible; height divisible but width not; both divisible.
    One size per class that an allowed size can fall in.
    """

    def side_near(default_side: int, divisible: bool, upward: bool, avoid: int | None = None) -> int | None:
        for step in range(1, max_size // multiple + 1):
            offsets = (step, -step) if upward else (-step, step)
            for side in (default_side + offset * multiple for offset in offsets):
                in_class = upsample_period is None or (side % upsample_period == 0) == divisible
                if min_size <= side <= max_size and in_class and side != avoid:
                    return side
        return None

    classes = [(True, True)]
    if upsample_period is not None and multiple % upsample_period != 0:
        classes = [(False, True), (True, False), (True, True)]  # (height divisible, width divisible)
    sizes = []
    for height_divisible, width_divisible in classes:
        width = side_near(default[0], width_divisible, upward=True)
        height = side_near(default[1], height_divisible, upward=False, avoid=width)
        if width is not None and height is not None:
            sizes.append((width, height))
    return sizes


def token_class_sizes(
    default: tuple[int, int], multiple: int, min_size: int, max_size: int, token_padding: tuple[int, int]
) -> list[tuple[int, int]]:
    """Sizes other than the default, one whose image-token count is a multiple of the period and one whose is not.

    `token_padding` is (pixels per token side, period): Z-Image's transformer pads its image tokens to a multiple
    of the period only where they fall short, so a graph's guards split sizes by that remainder, and each class
    needs a size of its own (both sides off the default's and width off height, as warm_up_sizes' are) to be
    compiled with dynamic sides.
    """
    pixels, period = token_padding
    found: dict[bool, tuple[int, int]] = {}
    sides = [side for side in range(min_size, max_size + 1, multiple) if side not in default]
    # Nearest the default first: the sizes a warm-up runs cost about what requests do.
    for width in sorted(sides, key=lambda side: (abs(side - default[0]), side)):
        for height in sorted(sides, key=lambda side: (abs(side - default[1]), side)):
            divisible = (width // pixels) * (height // pixels) % period == 0
            if width != height and divisible not in found:
                found[divisible] = (width, height)
        if len(found) == 2:
            break
    return [found[divisible] for divisible in (True, False) if divisible in found]


def warm_up_requests(
    rules: RequestRules,
    upsample_period: int | None,
    guidances: tuple[float | None, ...],
    text_length_varies: bool = False,
    token_padding: tuple[int, int] | None = None,
) -> list[GenerationRequest]:
    """The default-size request, then each of `warm_up_sizes` at each guidance (None: the model's default); with
    `text_length_varies`, the default size too, each with a long and a short prompt, so the text's length is
    dynamic in every graph; with `token_padding`, sizes of both token_class_sizes classes in place of
    warm_up_sizes'."""
    defaults = rules.defaults
    default = (defaults.width, defaults.height)
    if token_padding is not None:
        sizes = token_class_sizes(default, rules.size_multiple, rules.min_size, rules.max_size, token_padding)
    else:
        sizes = warm_up_sizes(default, rules.size_multiple, rules.min_size, rules.max_size, upsample_period)
    requests = [GenerationRequest(prompt=WARM_UP_PROMPT, seed=0, num_inference_steps=WARM_UP_STEPS)]
    # A text as long as its prompt: both lengths at every size and guidance, since a graph's guards may also split
    # on the text's length (Z-Image pads text and image tokens to multiples of 32 only where they fall short).
    prompts = (WARM_UP_LONG_PROMPT, WARM_UP_PROMPT) if text_length_varies else (WARM_UP_PROMPT,)
    default_size = [(defaults.width, defaults.height)] if text_length_varies else []
    for width, height in default_size + sizes:
        requests += [
            GenerationRequest(
                prompt=prompt, seed=0, num_inference_steps=WARM_UP_STEPS, width=width, height=height,
                guidance_scale=guidance,
            )
            for guidance in guidances
            for prompt in prompts
        ]  # fmt: skip
    return requests


def warm_up_buckets(graph_buckets: tuple[int, ...], compiled: bool) -> tuple[int, ...]:
    """The slot's rank buckets the warm-up requests run at, the base model's (0, the first) included.

    Compiled, every one: each bucket is a graph of its own for every class of shapes, and a swap
    into a bucket no warm-up ran at would compile. Uncompiled, the base model's only: nothing is
    specialised, and one pass makes the first request's allocations.
    """
    return graph_buckets if compiled else graph_buckets[:1]
