"""--attention: the diffusers attention backend the denoiser's attention layers run on.

The names are diffusers' own (`AttentionBackendName`: `native` is torch's scaled_dot_product_attention, which on
CUDA picks a flash, memory-efficient or cuDNN kernel itself; `_native_cudnn`, `_native_flash`, ... pin one of
those; `flash`, `_flash_3`, `sage`, `xformers`, `flex`, ...), and `set_attention_backend` sets them, before any
compile. An explicit --attention is honoured on CUDA. Off CUDA every backend but native needs a GPU, so a known
name is accepted and the native one used, in one log line. SDXL's UNet has attention processors that call torch
directly, not diffusers' dispatcher: it always runs native.

Unset, on Hopper (compute capability 9.x), start-up measures: each installed candidate runs the model's own
attention shape at the largest size it serves (--max-size; a warm-up call, then a few calls timed with CUDA
events), and the fastest runs. It matters there: torch's SDPA prefers its FlashAttention-2 kernel over cuDNN's, which is about twice as fast
on Hopper (published H100 figures for FLUX's (1, 24, 4608, 128): FA2 330 TFLOP/s, cuDNN and FA3 630). A `*_hub`
backend is never a candidate: it fetches its kernel from the Hub at start-up, which servers without network cannot
(ask for one by name when its kernel is in the local cache). Elsewhere, unset runs native as before.

GetServerInfo.attention_backend names the kernel family that runs: the diffusers backend, or for native on CUDA
`native/<kernel>`, the SDPA kernel torch takes for that shape (`native/flash`, `native/cudnn`, ...).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraswap.server.engine.errors import StartupError

if TYPE_CHECKING:
    from loraswap.server.engine.pipeline.records import LoadedModel

log = logging.getLogger(__name__)

NATIVE = "native"
FLASH_3 = "_flash_3"
# The start-up measures on Hopper only: the one architecture where torch's own choice is known to leave a kernel
# about twice as fast unused (and where FlashAttention 3, built for it, runs).
HOPPER_MAJOR = 9
# What a start-up measures, listed first on a tie. Left out: `sage` (8-bit attention: other images), `flex` (fast
# only compiled), `xformers` and the varlen backends (no faster than these on a dense, unmasked shape), `*_hub`.
MEASURED_BACKENDS = ("_flash_3", "flash", "_native_cudnn", "_native_flash", "_native_efficient")
TIMED_CALLS = 5
# A candidate whose output differs from native's by more than this share of native's largest value is wrong, not
# rounded differently (bf16 kernels differ by well under 1%), and is skipped.
AGREEMENT = 0.05
# torch's SDPA kernels, as the `native/<kernel>` label names them.
_SDPA_KERNELS = {
    "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn", "MATH": "math",
}  # fmt: skip


def attention_backends() -> tuple[str, ...]:
    """Every name --attention takes: diffusers' AttentionBackendName values (imports diffusers)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return tuple(member.value for member in AttentionBackendName)


def _target_device(device: str | None) -> torch.device:
    return torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_attention(name: str | None, device: str | None) -> None:
    """Refuse an --attention value this process cannot serve, before anything is loaded.

    Raises:
        ValueError: a name diffusers does not know (the message lists those it does), or, on CUDA, a backend whose
            package is missing; one line that says what to change.
    """
    if name is None:
        return
    choices = attention_backends()
    if name.lower() not in choices:
        raise ValueError(f"--attention {name[:100]!r} is not an attention backend; use one of {', '.join(choices)}")
    if _target_device(device).type == "cuda":
        problem = _requirement_problem(name.lower())
        if problem is not None:
            raise ValueError(f"--attention {name.lower()} cannot run here: {problem}; install it or choose another")


def _requirement_problem(name: str) -> str | None:
    """diffusers' own check of what a backend needs (its package and version); None when it is met."""
    from diffusers.models import attention_dispatch

    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if check is None:  # another diffusers: set_attention_backend checks at start-up instead
        return None
    try:
        check(attention_dispatch.AttentionBackendName(name))
    except RuntimeError as error:
        return str(error).splitlines()[0].rstrip(".")
    return None


def installed(name: str) -> bool:
    """Whether this process has what diffusers needs to run backend `name` (its package; no GPU needed to tell)."""
    return _requirement_problem(name) is None


@dataclass(frozen=True)
class AttentionShape:
    """One attention call of the denoiser: batch, heads, tokens (queries and keys alike: self-attention), head size."""

    batch: int
    heads: int
    tokens: int
    head_dim: int

    @property
    def flops(self) -> int:
        """Multiply-adds of Q·Kᵀ and of P·V, two FLOPs each: the figure attention TFLOP/s are quoted in."""
        return 4 * self.batch * self.heads * self.tokens * self.tokens * self.head_dim

    def tflops(self, seconds: float) -> float:
        """TFLOP/s of one call that took `seconds`."""
        return self.flops / seconds / 1e12

    def __str__(self) -> str:
        return f"({self.batch}, {self.heads}, {self.tokens}, {self.head_dim})"


def attention_shape(loaded: LoadedModel, size: int | None = None) -> AttentionShape | None:
    """The shape of the denoiser's attention at `size`² pixels (None: the model's default width and height); None
    when its attention does not go through diffusers' backends (SDXL's UNet) or its config does not say its heads.

    Flux's blocks attend over one joint sequence: the packed latent patches (a token per `size_multiple` pixels
    each way) and the T5 prompt, padded to its max_sequence_length; a call's batch is the guidance's (call_batch).
    """
    denoiser = loaded.denoiser
    heads = getattr(denoiser.config, "num_attention_heads", None)
    head_dim = getattr(denoiser.config, "attention_head_dim", None)
    if not _dispatches(denoiser) or not isinstance(heads, int) or not isinstance(head_dim, int):
        return None
    defaults = loaded.defaults
    multiple = loaded.traits.size_multiple(loaded.pipe)
    text_tokens = defaults.max_sequence_length or _call_default(loaded.pipe, "max_sequence_length") or 0
    height, width = (size, size) if size is not None else (defaults.height, defaults.width)
    return AttentionShape(
        batch=loaded.traits.call_batch(loaded.pipe, defaults, defaults.guidance_scale),
        heads=heads,
        tokens=(height // multiple) * (width // multiple) + text_tokens,
        head_dim=head_dim,
    )


def _call_default(pipe, argument: str) -> int | None:
    """The pipeline's own default for a call argument (FluxPipeline: max_sequence_length 512)."""
    import inspect

    parameter = inspect.signature(pipe.__call__).parameters.get(argument)
    return parameter.default if parameter is not None and isinstance(parameter.default, int) else None


def installed_backends(
    usable: Callable[[str], bool] = installed, names: Sequence[str] = MEASURED_BACKENDS
) -> tuple[str, ...]:
    """The candidates among `names` that this process can run: never a `*_hub` one, and only where `usable` says
    the package is there (the benchmark measures these on any device)."""
    return tuple(name for name in names if not name.endswith("_hub") and usable(name))


def eligible_backends(
    capability: tuple[int, int] | None,
    usable: Callable[[str], bool] = installed,
    names: Sequence[str] = MEASURED_BACKENDS,
) -> tuple[str, ...]:
    """What a start-up with --attention unset measures on a device of this CUDA `capability` (None: not CUDA):
    the installed candidates on Hopper, nothing elsewhere (native runs, as torch chooses)."""
    if capability is None or capability[0] != HOPPER_MAJOR:
        return ()
    return installed_backends(usable, names)


def fastest(seconds: Mapping[str, float]) -> str | None:
    """The backend with the least measured time per call (the first listed among equals); None when none ran."""
    return min(seconds, key=seconds.__getitem__, default=None)


@dataclass(frozen=True)
class AttentionTimings:
    """What one measurement found: seconds per call (median) of each candidate that ran, in the order measured,
    and why each other one was skipped."""

    shape: AttentionShape
    seconds: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def tflops(self) -> dict[str, float]:
        """TFLOP/s of each candidate that ran."""
        return {name: self.shape.tflops(seconds) for name, seconds in self.seconds.items()}

    def summary(self) -> str:
        """One log line's worth: every candidate's TFLOP/s, then those skipped and why."""
        ran = [f"{name} {tflops:.3g} TFLOP/s" for name, tflops in self.tflops().items()]
        skipped = [f"{name} skipped ({why})" for name, why in self.skipped.items()]
        return ", ".join(ran + skipped)


def time_backends(
    names: Sequence[str], shape: AttentionShape, dtype: torch.dtype, device: torch.device, calls: int = TIMED_CALLS
) -> AttentionTimings:
    """Time each backend through diffusers' dispatcher (what the denoiser calls, layout copies included) on random
    queries, keys and values of `shape`: one untimed call (cuDNN builds its plan, a kernel loads), then `calls`
    timed ones, with CUDA events on CUDA (the host waits once per backend) and the wall clock elsewhere. A backend
    that raises, or whose output disagrees with native's, is skipped with the reason."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    started = time.perf_counter()
    generator = torch.Generator(device).manual_seed(0)
    size = (shape.batch, shape.tokens, shape.heads, shape.head_dim)  # diffusers' layout: (batch, tokens, heads, dim)
    query, key, value = (torch.randn(size, generator=generator, device=device, dtype=dtype) for _ in range(3))

    def run(name: str) -> torch.Tensor:
        return dispatch_attention_fn(query, key, value, backend=AttentionBackendName(name))

    seconds: dict[str, float] = {}
    skipped: dict[str, str] = {}
    # torch warns for every kernel it cannot use on the way to raising: the skip reason says it once.
    with torch.inference_mode(), warnings.catch_warnings(), _on(device):
        warnings.simplefilter("ignore")
        try:
            reference = run(NATIVE)
        except Exception as error:  # noqa: BLE001 - nothing to check the candidates against: none measured
            return AttentionTimings(shape, {}, {NATIVE: _reason(error)}, time.perf_counter() - started)
        for name in names:
            try:
                problem = agreement_problem(run(name), reference)
                if problem is not None:
                    skipped[name] = problem
                    continue
                seconds[name] = statistics.median(_call_seconds(functools.partial(run, name), calls, device))
            except Exception as error:  # noqa: BLE001 - a backend that cannot run this shape or dtype raises
                skipped[name] = _reason(error)
    return AttentionTimings(shape, seconds, skipped, time.perf_counter() - started)


def agreement_problem(output: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Why a candidate's `output` is wrong against native's `reference` on the same inputs (a difference beyond
    AGREEMENT of the reference's largest value, or not finite); None when it agrees (waits for the device)."""
    scale = float(reference.abs().max())
    difference = float((output.float() - reference.float()).abs().max())
    if difference <= AGREEMENT * scale:  # NaN compares false: not finite is wrong
        return None
    return f"differs from native by {difference:.3g}, whose largest value is {scale:.3g}"


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        yield


def _call_seconds(call: Callable[[], object], calls: int, device: torch.device) -> list[float]:
    """Seconds each of `calls` calls took on the device."""
    if device.type != "cuda":
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1000 for start, end in events]


def resolve_attention(
    name: str | None,
    device: torch.device,
    shape: AttentionShape | None = None,
    dtype: torch.dtype = torch.bfloat16,
    measure: Callable[..., AttentionTimings] = time_backends,
) -> str:
    """The backend to run: the one asked for on CUDA; unset on Hopper, the fastest installed one on `shape`
    (`measure` times them; none when `shape` is None); native elsewhere."""
    if device.type != "cuda":
        if name is not None and name.lower() != NATIVE:
            log.warning("--attention %s needs CUDA; %s runs the native backend (torch SDPA)", name.lower(), device)
        return NATIVE
    if name is not None:
        return name.lower()
    candidates = eligible_backends(torch.cuda.get_device_capability(device))
    if shape is None or not candidates:
        return NATIVE
    timings = measure(candidates, shape, dtype, device)
    chosen = fastest(timings.seconds) or NATIVE
    log.info(
        "attention: %s runs, measured on %s %s in %.0f ms: %s",
        chosen, shape, str(dtype).removeprefix("torch."), timings.elapsed_s * 1000, timings.summary(),
    )  # fmt: skip
    return chosen


def sdpa_kernel(shape: AttentionShape, dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel torch's SDPA takes for `shape` under its current settings (flash, efficient, cudnn or math;
    `fa3`/`fa4` when torch's flash kernel is swapped for one), or None when torch cannot say."""
    from torch.nn.attention import SDPBackend

    # What native hands SDPA: the denoiser's (batch, tokens, heads, dim) seen as (batch, heads, tokens, dim). The
    # choice reads sizes, strides, dtype and device, never values.
    size = (shape.batch, shape.tokens, shape.heads, shape.head_dim)
    query = torch.empty(size, dtype=dtype, device=device).permute(0, 2, 1, 3)
    try:
        kernel = _SDPA_KERNELS.get(SDPBackend(torch._fused_sdp_choice(query, query, query)).name)
    except (AttributeError, RuntimeError, ValueError):  # a torch without the query, or a choice it cannot name
        return None
    current = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)()
    return current.lower() if kernel == "flash" and current else kernel


def choose_attention(
    name: str | None, loaded: LoadedModel, measure: Callable[..., AttentionTimings] = time_backends
) -> str:
    """Resolve --attention for the loaded model, set it on the denoiser (before compiling it), and return what
    GetServerInfo.attention_backend says: the backend that runs, or for native on CUDA `native/<kernel>`.

    Raises:
        StartupError: diffusers cannot set the backend (see apply_attention).
    """
    shape = attention_shape(loaded)
    # Measured at the largest image the server takes: where a step costs most, and where the kernels differ (at a
    # small default size, random-flux's 128², launch overhead hides them).
    largest = attention_shape(loaded, loaded.request_rules.max_size)
    running = apply_attention(loaded.denoiser, resolve_attention(name, loaded.device, largest, loaded.dtype, measure))
    if running != NATIVE or loaded.device.type != "cuda" or shape is None:
        return running  # SDXL's UNet calls SDPA at many shapes: no one kernel to name
    kernel = sdpa_kernel(shape, loaded.dtype, loaded.device)
    return f"{NATIVE}/{kernel}" if kernel else NATIVE


def _dispatches(denoiser: torch.nn.Module) -> bool:
    """Whether any attention processor of the denoiser goes through diffusers' backend dispatcher."""
    return any(hasattr(getattr(module, "processor", None), "_attention_backend") for module in denoiser.modules())


@contextlib.contextmanager
def _quiet_diffusers() -> Iterator[None]:
    # set_attention_backend warns on every call that backends are experimental: noise in every start-up log.
    logger = logging.getLogger("diffusers.models.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def apply_attention(denoiser: torch.nn.Module, backend: str) -> str:
    """Set `backend` on the denoiser's attention (before compiling it); returns the backend that now runs.

    Raises:
        StartupError: diffusers cannot set it (its package is missing, a Hub kernel that is not cached).
    """
    if not hasattr(denoiser, "set_attention_backend") or not _dispatches(denoiser):
        if backend != NATIVE:
            log.warning(
                "--attention %s: %s's attention does not go through diffusers' backends; it runs native",
                backend, type(denoiser).__name__,
            )  # fmt: skip
        return NATIVE
    try:
        with _quiet_diffusers():
            denoiser.set_attention_backend(backend)
    # diffusers signals a missing package with RuntimeError and a failed kernel fetch with whatever the Hub raises.
    except Exception as error:
        first_line = (str(error).splitlines() or [type(error).__name__])[0][:300]
        raise StartupError(f"--attention {backend} cannot be set: {first_line}; choose another backend") from error
    return backend
