"""Plain domain types shared by the engine and whatever front end serves it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class FuseChoice(enum.Enum):
    """How a request pins the way its adapters are applied (GenerateRequest.fuse); None: the server's --fuse."""

    FUSED = "fused"  # merged into the base weights
    UNFUSED = "unfused"  # in the swap slot


class ImageFormat(enum.Enum):
    """Encoding of a generated image."""

    PNG = "png"
    JPEG = "jpeg"
    WEBP = "webp"

    @property
    def mime_type(self) -> str:
        return f"image/{self.value}"


class ModelFamily(enum.Enum):
    """Architecture of the resident pipeline."""

    FLUX = "flux"
    SDXL = "sdxl"
    QWEN_IMAGE = "qwen-image"
    Z_IMAGE = "z-image"
    FLUX2 = "flux2"


@dataclass(frozen=True)
class ModelDefaults:
    """Generation settings that fit a model when a request leaves them unset."""

    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    max_sequence_length: int | None = None
    # FLUX.1: > 1 runs true classifier-free guidance against the negative prompt ("" when unset). Qwen-Image's
    # guidance is true CFG itself: its guidance_scale is passed as true_cfg_scale (family_traits/qwen_image.py).
    true_cfg_scale: float = 1.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelDefaults:
        """From the form `to_dict` writes (a model folder's loraswap_generation.json)."""
        return cls(
            width=values["width"],
            height=values["height"],
            num_inference_steps=values["num_inference_steps"],
            guidance_scale=values["guidance_scale"],
            max_sequence_length=values.get("max_sequence_length"),
            true_cfg_scale=values.get("true_cfg_scale", 1.0),
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings as pipeline keyword arguments, leaving out the unset ones (no sequence length, no true CFG)."""
        values: dict[str, Any] = dict(
            width=self.width,
            height=self.height,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
        )
        if self.max_sequence_length is not None:
            values["max_sequence_length"] = self.max_sequence_length
        if self.true_cfg_scale != 1.0:
            values["true_cfg_scale"] = self.true_cfg_scale
        return values


@dataclass(frozen=True)
class StackedAdapter:
    """One adapter of a request and its strength (None in a request: 1.0)."""

    adapter: str
    scale: float | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """What a caller asked for; None means "use the model's default"."""

    prompt: str
    negative_prompt: str = ""
    adapter: str = ""
    adapter_scale: float | None = None
    adapters: tuple[StackedAdapter, ...] = ()  # a stack; not with `adapter` / `adapter_scale`
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    image_format: ImageFormat = ImageFormat.PNG
    preview_every: int = 0  # a preview every this many steps and at the last; 0: none
    fuse: FuseChoice | None = None  # the path pinned by the caller; None: the server's --fuse policy
    # URL adapters are named by their public identity (adapters/sources/url_names.py); identity -> the full URL the caller
    # sent, a secret that only the fetcher sees (never shown: not in repr, not compared).
    adapter_links: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class GenerationParams:
    """A validated request with every default filled in."""

    prompt: str
    negative_prompt: str
    # Every adapter to apply, in the request's order, each with its strength: one for a
    # single adapter, none for the base model.
    adapters: tuple[StackedAdapter, ...]
    num_inference_steps: int
    guidance_scale: float
    width: int
    height: int
    seed: int
    image_format: ImageFormat
    preview_every: int = 0  # a preview every this many steps and at the last; 0: none
    fuse: FuseChoice | None = None  # the path pinned by the caller; None: the server's --fuse policy

    def wants_preview(self, step: int) -> bool:
        """Whether step `step` (1-based) carries a preview: every preview_every-th step and the last."""
        every = self.preview_every
        return every > 0 and (step % every == 0 or step == self.num_inference_steps)

    @property
    def adapter(self) -> str:
        """The adapter when exactly one is applied; empty for the base model and for a stack."""
        return self.adapters[0].adapter if len(self.adapters) == 1 else ""

    @property
    def adapter_scale(self) -> float:
        """The strength when exactly one adapter is applied; 1.0 otherwise."""
        return self.adapters[0].scale if len(self.adapters) == 1 else 1.0


@dataclass(frozen=True)
class Queued:
    """The request waits; position 1 runs next.

    `loading_adapter`: its adapter is still being fetched, read or converted (position 0 then), so a caller can
    tell "loading adapter" from "waiting for the pipeline".
    """

    position: int
    loading_adapter: bool = False
    # While URL adapters download (a stack's summed): bytes written so far, and the totals their servers announced
    # (0: not announced).
    downloaded_bytes: int = 0
    download_total_bytes: int = 0


@dataclass(frozen=True)
class LatentRgb:
    """A linear map from a latent pixel to an RGB pixel in about [-1, 1]: rgb = latent @ factors + bias.

    `factors` has one (r, g, b) row per latent channel; they apply to latents as the pipeline
    denoises them (scaled and shifted, before the VAE's decode undoes that).
    """

    factors: tuple[tuple[float, float, float], ...]
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def channels(self) -> int:
        return len(self.factors)

    @classmethod
    def grey(cls, channels: int) -> LatentRgb:
        """The channels' mean as a grey level: the preview of a latent space nobody fitted factors for."""
        return cls(factors=((1.0 / channels,) * 3,) * channels)


@dataclass(frozen=True)
class StepProgress:
    """One denoising step has completed."""

    step: int
    total_steps: int
    elapsed_ms: float
    # With GenerationParams.preview_every: the encoded preview of the latents after this step.
    preview: bytes = field(default=b"", repr=False)
    preview_mime_type: str = ""


@dataclass(frozen=True)
class Timings:
    """Where a generation's time went, in milliseconds."""

    queue_ms: float = 0.0
    adapter_load_ms: float = 0.0
    adapter_swap_ms: float = 0.0
    denoise_ms: float = 0.0  # the prompt encoded and the steps run
    decode_ms: float = 0.0  # from the last step to the file written: the VAE decode, then the encoding
    total_ms: float = 0.0
    encode_prompt_ms: float = 0.0  # the part of denoise_ms spent in the text encoders
    encode_image_ms: float = 0.0  # the part of decode_ms spent writing the file (PNG, JPEG, WebP)


@dataclass(frozen=True)
class GeneratedImage:
    """A finished generation, encoded."""

    data: bytes
    image_format: ImageFormat
    width: int
    height: int
    seed: int
    adapter: str
    adapter_scale: float
    timings: Timings
    warnings: tuple[str, ...] = ()
    adapters: tuple[StackedAdapter, ...] = ()  # every adapter applied, as in GenerationParams
    fused: bool = False  # the adapters were merged into the base weights (--fuse), not run in the swap slot
    changed_components: tuple[str, ...] = ()  # the denoiser and any text encoder the adapters changed, sorted


GenerationEvent = Queued | StepProgress | GeneratedImage


@dataclass(frozen=True)
class AdapterSummary:
    """What the server knows about one cached adapter."""

    id: str
    rank: int
    target_layers: tuple[str, ...]
    bytes: int
    source: str
    hits: int
    last_used_unix_ms: int
    resident: bool
    load_ms: float
    warnings: tuple[str, ...] = ()
    pinned: bool = False  # kept out of LRU eviction (--pin)
    kinds: tuple[str, ...] = ()  # the kinds of weight change it makes (lora, dora, loha, lokr, full, ...)
    component_layers: Mapping[str, int] = field(default_factory=dict)  # component -> layers it changes there
    must_fuse: bool = False  # only a fused swap can apply it


@dataclass(frozen=True)
class AdapterCacheSummary:
    """The adapter cache's contents, most recently used first."""

    adapters: tuple[AdapterSummary, ...]
    cache_bytes: int
    cache_budget_bytes: int


@dataclass(frozen=True)
class PreloadResult:
    """Outcome of a preload."""

    adapter: AdapterSummary
    already_cached: bool
    # A URL adapter's fetch for this preload: its milliseconds and the body bytes that came (0 when the file was
    # on disk already, or nothing was loaded).
    download_ms: float = 0.0
    download_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class RuntimeFacts:
    """What the resident runtime says of itself: the model as loaded, its slot, compile and storage, and what is
    resident. Snapshotted on the worker thread, so whoever reads it never touches the runtime."""

    family: ModelFamily
    dtype: str
    device: str
    max_rank: int
    target_layers: tuple[str, ...]
    compiled: bool
    recompilations: int
    resident_adapter: str  # the resident adapter's name when it is alone; "" for the base model and a stack
    size_multiple: int
    min_size: int
    max_size: int
    default_width: int
    default_height: int
    default_num_inference_steps: int
    default_guidance_scale: float
    resident_adapters: tuple[str, ...] = ()  # every adapter in the slot (a stack's members), by name
    max_stack: int = 1
    quantization: str = "none"  # none, int8wo or fp8: how the denoiser's base linear weights are stored
    denoiser_weight_bytes: int = 0  # the denoiser's weights as stored
    attention_backend: str = "native"
    pinned_adapter_memory: bool = False  # cached adapters in pinned host memory (CUDA only)
    device_adapter_bytes: int = 0  # device memory for a hot set of adapters; 0 when none
    compile_mode: str = "none"  # e.g. "full/default", "regional/default"; "none" when eager
    rank_buckets: tuple[int, ...] = ()  # the slot's rank buckets
    fuse: str = ""  # --fuse: never, always or auto
    fuse_pristine_bytes: int = 0  # the pristine copies of the slot layers' base weights fused swaps merge from
    torch_threads: int = 0  # torch's CPU threads, fixed; 0 when they follow the machine's load (--torch-threads 0)


@dataclass(frozen=True, kw_only=True)
class ServerDescription(RuntimeFacts):
    """The resident model and its swap slot: the runtime's facts, and the server's name for what it serves."""

    model: str
    base_model: str = ""  # the served base in the vocabulary adapters declare theirs (a Hub repo id)
    warnings: tuple[str, ...] = field(default=())

    @classmethod
    def of(cls, facts: RuntimeFacts, *, model: str, base_model: str) -> ServerDescription:
        """The description of a server serving `model` (its base in adapters' vocabulary: `base_model`)."""
        own = {item.name: getattr(facts, item.name) for item in fields(RuntimeFacts)}
        return cls(model=model, base_model=base_model, **own)
