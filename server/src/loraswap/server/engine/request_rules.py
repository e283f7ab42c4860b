"""What a request may ask of the resident model: a frozen value that validates requests and fills in defaults.

`RequestRules` holds plain numbers only (no pipeline, no torch), so the engine checks
requests on the event loop, before they queue, and tests build it directly.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from loraswap.server.engine.config import DEFAULT_MAX_STACK
from loraswap.server.engine.errors import ErrorReason, InvalidRequestError
from loraswap.server.engine.scale_limits import MAX_ADAPTER_SCALE
from loraswap.server.engine.types import (
    GenerationParams,
    GenerationRequest,
    ImageFormat,
    ModelDefaults,
    StackedAdapter,
)

MAX_STEPS = 200
MAX_GUIDANCE = 50.0
MAX_PROMPT_CHARS = 4000


@dataclass(frozen=True)
class RequestRules:
    """The resident model's defaults and the sizes it accepts; `resolve` turns a request into parameters."""

    defaults: ModelDefaults
    size_multiple: int  # width and height must be multiples of this
    min_size: int  # smallest width or height (a multiple of size_multiple)
    max_size: int  # largest width or height
    # Why the model ignores negative prompts (the warning a request sending one gets); None: it reads them.
    ignored_negative_prompt: str | None = None
    # The guidance above which the model reads a negative prompt (it runs classifier-free guidance there); None: at
    # any guidance it reads one at all.
    negative_prompt_read_above: float | None = None
    max_stack: int = DEFAULT_MAX_STACK  # most entries `adapters` may have
    # Fewest steps the model's scheduler can take (2 where one step divides by zero, as Qwen-Image's terminal shift).
    min_steps: int = 1

    def resolve(self, request: GenerationRequest) -> GenerationParams:
        """Validate a request against this model and fill in its defaults.

        Raises:
            InvalidRequestError: naming the first field out of range (metadata `field`) and what would be valid.
        """
        if not request.prompt.strip():
            raise InvalidRequestError("prompt is empty; describe the image to generate", field="prompt")
        if len(request.prompt) > MAX_PROMPT_CHARS or len(request.negative_prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompts are limited to {MAX_PROMPT_CHARS} characters", field="prompt")
        defaults = self.defaults
        steps = defaults.num_inference_steps if request.num_inference_steps is None else request.num_inference_steps
        if not self.min_steps <= steps <= MAX_STEPS:
            raise InvalidRequestError(
                f"num_inference_steps is {steps}; use {self.min_steps} to {MAX_STEPS}, or leave it unset for the "
                f"model's default ({defaults.num_inference_steps})",
                field="num_inference_steps",
            )
        guidance = defaults.guidance_scale if request.guidance_scale is None else request.guidance_scale
        if not 0.0 <= guidance <= MAX_GUIDANCE:
            raise InvalidRequestError(f"guidance_scale is {guidance}; use 0 to {MAX_GUIDANCE}", field="guidance_scale")
        scale = _check_scale("adapter_scale", request.adapter_scale)
        adapters = self._adapters(request, scale)
        width = self._check_size("width", request.width, defaults.width)
        height = self._check_size("height", request.height, defaults.height)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        if not 0 <= seed < 2**64:
            raise InvalidRequestError("seed must lie in [0, 2^64)", field="seed")
        # Any positive value is valid: one at or above the step count means "the last step only".
        if request.preview_every < 0:
            raise InvalidRequestError(
                f"preview_every is {request.preview_every}; use 0 for no previews or N > 0 for one every N steps "
                "and at the last",
                field="preview_every",
            )
        params = GenerationParams(
            prompt=request.prompt, negative_prompt=request.negative_prompt, adapters=adapters,
            num_inference_steps=steps, guidance_scale=guidance, width=width, height=height, seed=seed,
            image_format=request.image_format, preview_every=request.preview_every, fuse=request.fuse,
        )  # fmt: skip
        check_encodable(params)  # a file that would take seconds to write is refused before the request queues
        return params

    def warnings(self, params: GenerationParams) -> tuple[str, ...]:
        """What the caller should know about how these parameters will be read."""
        if params.negative_prompt and self.ignored_negative_prompt:
            return (self.ignored_negative_prompt,)
        above = self.negative_prompt_read_above
        if params.negative_prompt and above is not None and params.guidance_scale <= above:
            ignored = (
                f"negative_prompt is ignored at guidance_scale {params.guidance_scale:g}: this model reads it only "
                f"above {above:g}, where it runs classifier-free guidance"
            )
            return (ignored,)
        return ()

    def _adapters(self, request: GenerationRequest, scale: float) -> tuple[StackedAdapter, ...]:
        """The adapters to apply with their strengths: the single `adapter`, or the `adapters` stack."""
        if not request.adapters:
            return (StackedAdapter(request.adapter, scale),) if request.adapter else ()
        if request.adapter or request.adapter_scale is not None:
            field = "adapter" if request.adapter else "adapter_scale"
            raise InvalidRequestError(
                f"the request sets both {field} and adapters; name one adapter with adapter (and adapter_scale), "
                "or several with adapters, each with its own scale",
                reason=ErrorReason.ADAPTER_MISMATCH,
                field=field,
            )
        if len(request.adapters) > self.max_stack:
            raise InvalidRequestError(
                f"adapters has {len(request.adapters)} entries; this server stacks at most {self.max_stack} "
                "(--max-stack)",
                field="adapters",
            )
        stack, seen = [], set()
        for index, entry in enumerate(request.adapters):
            if not entry.adapter:
                raise InvalidRequestError(
                    f"adapters[{index}].adapter is empty; name an adapter in every entry", field="adapters"
                )
            if entry.adapter in seen:
                raise InvalidRequestError(
                    f"adapter {entry.adapter!r} appears twice in adapters; list each adapter once, with the "
                    "strength it should have",
                    field="adapters",
                )
            seen.add(entry.adapter)
            stack.append(StackedAdapter(entry.adapter, _check_scale(f"adapters[{index}].scale", entry.scale)))
        return tuple(stack)

    def _check_size(self, field: str, value: int | None, default: int) -> int:
        if value is None:
            return default
        multiple, smallest, largest = self.size_multiple, self.min_size, self.max_size
        if not smallest <= value <= largest or value % multiple:
            nearest = min(max(smallest, round(value / multiple) * multiple), largest)
            raise InvalidRequestError(
                f"{field} is {value}; it must be a multiple of {multiple} between {smallest} and "
                f"{largest} for this model (nearest valid: {nearest})",
                field=field,
                multiple=multiple,
            )
        return value


def _check_scale(field: str, value: float | None) -> float:
    """An adapter strength (None: 1.0) within +-MAX_ADAPTER_SCALE."""
    scale = 1.0 if value is None else float(value)
    if not -MAX_ADAPTER_SCALE <= scale <= MAX_ADAPTER_SCALE:
        raise InvalidRequestError(f"{field} is {scale}; use -{MAX_ADAPTER_SCALE} to {MAX_ADAPTER_SCALE}", field=field)
    return scale


# Lossless WebP at the least effort costs about 0.06 s per megapixel on one core (1024² and 2048² pictures, README's
# "Image formats"): 8 megapixels (4096x2048) take about half a second, a second on a core half as fast.
MAX_WEBP_PIXELS = 8 * 2**20


def check_encodable(params: GenerationParams) -> None:
    """Refuse a request whose file would take seconds to write (lossless WebP above MAX_WEBP_PIXELS).

    Raises:
        InvalidRequestError: naming `image_format`, and the formats that write such an image quickly.
    """
    pixels = params.width * params.height
    if params.image_format is ImageFormat.WEBP and pixels > MAX_WEBP_PIXELS:
        raise InvalidRequestError(
            f"lossless WebP is limited to {MAX_WEBP_PIXELS // 2**20} megapixels ({params.width}x{params.height} is "
            f"{pixels / 2**20:.1f}): above that it takes seconds to encode; ask for PNG or JPEG, or a smaller size",
            field="image_format",
        )
