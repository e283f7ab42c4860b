"""Marks on the device's timeline and copies to the host that do not wait for the device.

On CUDA a mark is an event recorded on the current stream, and a copy to the host goes into pinned memory with
`non_blocking=True`: the host queues both and carries on, and waits only when it asks a mark whether the device has
passed it (`DeviceMark.wait`). On the CPU the work is done when the call returns, so a mark is a timestamp, waiting
is a no-op, and a copy is a plain copy: the same code runs, and CPU tests exercise its logic.
"""

from __future__ import annotations

import time

import torch


class DeviceMark:
    """A point in the device's work: its time is known once the device has passed it."""

    def __init__(self, device: torch.device) -> None:
        self._event = None
        self._host_time = time.perf_counter()
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()

    def wait(self) -> None:
        """Block until the device has done everything queued before this mark (on the CPU: at once)."""
        if self._event is not None:
            self._event.synchronize()

    def ms_since(self, earlier: DeviceMark) -> float:
        """Milliseconds of device time from `earlier` to this mark; call once both are passed (after `wait`)."""
        if self._event is not None and earlier._event is not None:
            return earlier._event.elapsed_time(self._event)
        return (self._host_time - earlier._host_time) * 1000.0


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor that will hold `tensor`'s values once the device passes a mark made after this call.

    On CUDA: pinned memory filled by an asynchronous copy, so the host does not wait for the device here; read it
    only after such a mark's `wait`. On the CPU: a copy, complete at once.
    """
    pinned = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    host.copy_(tensor, non_blocking=True)
    return host
