"""torch.compile for the resident denoiser: a backend that counts its graphs, and the settings that keep them few."""

from __future__ import annotations

import contextlib
import threading

import torch

# Past this many graphs per frame dynamo silently runs the model uncompiled (and nothing
# would count it); SDXL's warm-up alone makes 7, so leave room.
RECOMPILE_LIMIT = 32


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles, then defers to the real one.

    `mode` is torch.compile's mode for inductor ("default": inductor as `backend="inductor"` gives it).
    """

    def __init__(self, name: str, mode: str = "default") -> None:
        self.name = name
        self.mode = mode
        self.graphs_compiled = 0

    def __call__(self, graph_module, example_inputs):
        import torch._dynamo

        self.graphs_compiled += 1
        if self.name == "inductor" and self.mode != "default":
            # What torch.compile(backend="inductor", mode=...) itself builds: inductor with the mode's config patches.
            return torch._TorchCompileInductorWrapper(self.mode, None, None)(graph_module, example_inputs)
        return torch._dynamo.lookup_backend(self.name)(graph_module, example_inputs)


def compile_counting(
    module: torch.nn.Module, backend: str, *, kind: str = "full", mode: str = "default"
) -> CountingBackend:
    """Compile `module` in place through a CountingBackend for `backend`, with room for RECOMPILE_LIMIT graphs.

    kind "full" compiles the whole module; "regional" only its repeated blocks (diffusers'
    `compile_repeated_blocks`, the classes in the model's `_repeated_blocks`), whose blocks of
    one class share their graphs, so a swap (values only) recompiles none of them either.
    """
    counter = CountingBackend(backend, mode)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if kind == "regional":
        if not getattr(module, "_repeated_blocks", None):
            raise ValueError(
                f"--compile regional needs a denoiser with repeated blocks; {type(module).__name__} names none: "
                "use --compile full"
            )
        module.compile_repeated_blocks(backend=counter)
    else:
        module.compile(backend=counter)
    return counter


class OneDnnOff:
    """torch.backends.mkldnn.enabled = False while any runtime is inside; restored when the last one leaves.

    The flag is process-wide, so runtimes on different worker threads share one count
    instead of each saving and restoring it (which could leave it off for good).
    """

    _lock = threading.Lock()
    _inside = 0
    _previous = True

    def __enter__(self) -> None:
        with self._lock:
            if OneDnnOff._inside == 0:
                OneDnnOff._previous = torch.backends.mkldnn.enabled
                torch.backends.mkldnn.enabled = False
            OneDnnOff._inside += 1

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            OneDnnOff._inside -= 1
            if OneDnnOff._inside == 0:
                torch.backends.mkldnn.enabled = OneDnnOff._previous


def conv_backend(*, compiled: bool, convolutional: bool, device: torch.device, dtype: torch.dtype):
    """oneDNN off for a compiled float32 convolutional denoiser (SDXL's UNet) on CPU; otherwise nothing.

    For a float32 CPU convolution at batch 1, torch picks oneDNN or its native kernel by
    `input.numel() > 20480` (aten use_mkldnn, asked by the fake-tensor conv in
    torch/_subclasses/fake_impls.py via torch._C._select_conv_backend), so each conv
    guards its C*H*W against 20480 and guidance-off requests at a new side of any such
    threshold compile again. With oneDNN off the question is never asked. (It also covers the
    VAE and text encoders, which run a little slower without oneDNN: a test-sized set-up only,
    since served models run in bfloat16 or float16.)
    """
    if compiled and convolutional and device.type == "cpu" and dtype == torch.float32:
        return OneDnnOff()
    return contextlib.nullcontext()
