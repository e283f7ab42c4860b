"""Counting the times the host waits for the device: a torch dispatch mode for tests and benchmarks.

    from loraswap.server.devtools.host_syncs import HostSyncCounter

    with HostSyncCounter(pipe.device, watched=pipe.components.values()) as counter, counter.steps_of(pipe.scheduler):
        pipe(...)
    counter.syncs        # every wait counted
    counter.per_step     # [before the first step's end, after step 1, ..., after the last step]
    counter.seen         # what was counted, for a failure message

A host waits for the device when it needs a value the device computed: a scalar read (`.item()`, `bool(t)`,
`float(t)`: `aten::_local_scalar_dense`, or `is_nonzero`/`item` as inference mode dispatches them), an op whose
result's size depends on values (`nonzero`, `masked_select`), a comparison answered on the host (`equal`,
`allclose`), or a copy to host memory that is not asynchronous. What counts as the device's value:

- on CUDA (any device but the CPU): a tensor on that device. A copy from it to the host counts unless it is
  `non_blocking` into pinned memory (the copy then does not wait; reading its destination before an event has
  passed would be a race, not a wait, and no counter sees races). The GPU check uses
  `torch.cuda.set_sync_debug_mode` beside this, which sees the waits inside kernels' launch code too.
- on the CPU everything lives in host memory, so the counter follows where values come from instead: a tensor
  computed, through any chain of ops, from the weights and buffers of the `watched` modules (the pipeline's
  denoiser, text encoders, VAE) is the device's, as it would be on a GPU. Everything else stays the host's: the
  noise drawn from a CPU generator before the first step, and the tensors diffusers' schedulers keep on the CPU
  on purpose (`sigmas`, "to avoid too much CPU/GPU communication"), whose reads (EulerDiscreteScheduler compares
  a sigma with `s_tmin` on the host every step) are no waits on a GPU either. A `non_blocking` copy into a host
  tensor ends the lineage: on a GPU it is the copy into pinned memory that waits for nothing. On the CPU only
  scalar reads can be seen (a host tensor is read through `.numpy()` or `.tolist()` without any op).

Dispatch modes are per thread: enter the counter on the thread that runs the pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from loraswap.server.engine.pipeline.call_hooks import around_calls

# Ops whose answer reaches the host: a scalar read, a size that depends on values, a comparison's verdict.
_READS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.item",
        "aten.is_nonzero",
        "aten.equal",
        "aten.allclose",
        "aten.nonzero",
        "aten.masked_select",
    }
)
_COPIES = frozenset({"aten.copy_", "aten._to_copy", "aten.to", "aten._copy_from", "aten._copy_from_and_resize"})


@dataclass(frozen=True)
class HostSync:
    """One counted wait: the op, the shape and device of the value it waited for, and the step it fell in."""

    op: str
    shape: tuple[int, ...]
    device: str
    step: int


class HostSyncCounter(TorchDispatchMode):
    """Counts the ops that make the host wait for `device` (see the module docstring for what counts)."""

    def __init__(self, device: torch.device | str = "cuda", watched: Iterable[object] = ()) -> None:
        """`watched`: on the CPU, the modules (or any objects; non-modules are skipped) whose weights' results count
        as the device's; required there, ignored on other devices."""
        super().__init__()
        self.device = torch.device(device)
        self.seen: list[HostSync] = []
        self._step = 0
        self._per_step = [0]
        self._tracing = self.device.type == "cpu"
        # On the CPU: the tensors holding the device's values, by identity (a tensor's == is elementwise).
        self._device_values = WeakIdKeyDictionary()
        if self._tracing:
            modules = [module for module in watched if isinstance(module, torch.nn.Module)]
            if not modules:
                raise ValueError("on the CPU, name the modules whose results count as the device's (watched=...)")
            for module in modules:
                self._mark_device_values([*module.parameters(), *module.buffers()])

    @property
    def syncs(self) -> int:
        """Every wait counted so far."""
        return len(self.seen)

    @property
    def per_step(self) -> list[int]:
        """Waits between step boundaries: [before the first boundary, after it, ..., after the last]."""
        return list(self._per_step)

    def next_step(self) -> None:
        """A step boundary: later waits count for the next step."""
        self._step += 1
        self._per_step.append(0)

    def steps_of(self, scheduler: object) -> contextlib.AbstractContextManager[None]:
        """A step boundary after each call of `scheduler.step` (diffusers' pipelines call it once per step, after
        the denoiser and before the step-end callback)."""
        return around_calls(scheduler, "step", after=self.next_step)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if name in _READS:
            read = next((tensor for tensor in inputs if self._is_device_value(tensor)), None)
            if read is not None:
                self._count(name, read)
        result = func(*args, **kwargs)
        outputs = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        if name in _COPIES:
            self._copied(func, args, kwargs, inputs, outputs)
        elif self._tracing and any(tensor in self._device_values for tensor in inputs):
            self._mark_device_values(outputs)
        return result

    def _is_device_value(self, tensor: torch.Tensor) -> bool:
        if self._tracing:
            return tensor in self._device_values
        return tensor.device.type == self.device.type

    def _mark_device_values(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._device_values[tensor] = True

    def _copied(self, func, args, kwargs, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """A copy: counted when it brings a device value to the host and waits for it; on the CPU, the lineage."""
        source = _argument(func, args, kwargs, "src") if func.overloadpacket is torch.ops.aten.copy_ else None
        source = source if isinstance(source, torch.Tensor) else inputs[0] if inputs else None
        if source is None or not outputs:
            return
        target = outputs[0]
        asynchronous = bool(_argument(func, args, kwargs, "non_blocking"))
        if self._tracing:
            if source in self._device_values and not asynchronous:
                self._mark_device_values(outputs)
            else:
                self._device_values.pop(target, None)
            return
        to_host = self._is_device_value(source) and target.device.type == "cpu"
        if to_host and not (asynchronous and target.is_pinned()):
            self._count(str(func.overloadpacket), source)

    def _count(self, op: str, tensor: torch.Tensor) -> None:
        self.seen.append(HostSync(op=op, shape=tuple(tensor.shape), device=str(tensor.device), step=self._step))
        self._per_step[-1] += 1


def _argument(func, args, kwargs, name: str):
    """The value of argument `name` of an op call (None when the op has no such argument)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if index < len(args):
                return args[index]
            return kwargs.get(name, argument.default_value if argument.has_default_value() else None)
    return None
