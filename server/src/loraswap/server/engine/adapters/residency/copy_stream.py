"""Where the swap slot's copies run: on CUDA, a side stream that the denoising stream waits on.

Cached adapters live in pinned host memory on CUDA (formats/admission.py), so their copies into the slot are
`non_blocking` DMA transfers. They run on a stream of their own: it first waits for the work already queued
on the denoising (current) stream, which may still read the slot, and the denoising stream then waits for
an event recorded after the copies, so no kernel queued after a swap sees a half-written slot. The host
waits for that event alone (not for the device), which keeps the source tensors referenced until the copy
is over and the swap's milliseconds what the copy took. Off CUDA the copies simply run where they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class CopyStream:
    """The slot's copy stream on a CUDA device; on any other device (or none) copies run in place."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.active = device is not None and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.active else None

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Run the copies made inside on the side stream; on leaving, the denoising stream waits for them.

        The source tensors the copies read must stay referenced until this returns (it waits for the copies).
        """
        if not self.active:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # what is queued before the swap may still read the slot
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:  # after a failed copy too: whatever was queued must be over before the slot is used or rewritten
            done = torch.cuda.Event()
            done.record(self._stream)
            compute.wait_event(done)
            done.synchronize()
