"""--attention: the diffusers attention backend the denoiser's attention layers run on.

The names are diffusers' own (`AttentionBackendName`: `native` is torch's scaled_dot_product_attention, which on
CUDA picks a flash, memory-efficient or cuDNN kernel itself; `flash`, `_flash_3`, `sage`, `xformers`, `flex`,
...), and `set_attention_backend` sets them, before any compile. Unset, a CUDA server takes the fastest backend
whose package is installed (FlashAttention 3 on Hopper, else native): never a `*_hub` backend, which fetches its
kernel from the Hub at start-up and so does not suit servers without network (ask for one by name when its kernel
is in the local cache). Off CUDA every backend but native needs a GPU, so a known name is accepted and the native
one used, in one log line. SDXL's UNet has attention processors that call torch directly, not diffusers'
dispatcher: it always runs native. GetServerInfo.attention_backend says what runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from loraswap.server.engine.errors import StartupError

log = logging.getLogger(__name__)

NATIVE = "native"
FLASH_3 = "_flash_3"
# FlashAttention 3 (the `flash_attn_interface` package) is built for Hopper, compute capability 9.x.
FLASH_3_CAPABILITY_MAJOR = 9


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


def resolve_attention(name: str | None, device: torch.device) -> str:
    """The backend to run: the one asked for on CUDA (or the fastest installed one when unset); native elsewhere."""
    if device.type != "cuda":
        if name is not None and name.lower() != NATIVE:
            log.warning("--attention %s needs CUDA; %s runs the native backend (torch SDPA)", name.lower(), device)
        return NATIVE
    if name is not None:
        return name.lower()
    from diffusers.utils import is_flash_attn_3_available

    major, _ = torch.cuda.get_device_capability(device)
    if major == FLASH_3_CAPABILITY_MAJOR and is_flash_attn_3_available() and _requirement_problem(FLASH_3) is None:
        return FLASH_3
    return NATIVE


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
