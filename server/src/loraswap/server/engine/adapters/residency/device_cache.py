"""--device-adapter-bytes: the most recently swapped adapters kept on the device, so a swap between them stays there.

A swap copies an adapter's canonical tensors into the slot's. From (pinned) host memory that crosses the host
link; from a copy already on the device it is a device-to-device copy, an order of magnitude or two faster.
The hot set holds, for each adapter in it, a device copy of exactly the tensors the slot copies from (the
`AdapterSources` of swap_plan.py), within a byte budget, least recently swapped out first. An adapter
joins on its first swap (one host-to-device copy into the hot set, then the device copy into the slot) and
leaves when the budget needs its room, or when the adapter itself is gone (evicted from the host cache and
out of the slot): the hot set holds it weakly, so it never keeps an adapter, or a file's old version, alive.
Adapters larger than the whole budget, and any met when the device is out of memory, are copied from the host.

Nothing here depends on the device being CUDA; the runtime only turns the hot set on for CUDA (on a CPU the
host copy is already in device memory), and the unit tests run it with CPU tensors standing in.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from loraswap.server.engine.adapters.formats import CanonicalAdapter


@dataclass
class _HotAdapter:
    adapter: weakref.ref  # the CanonicalAdapter these are copies of
    sources: list[torch.Tensor]  # on the device, in the slot's copy order
    nbytes: int


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


class DeviceAdapterCache:
    """Device copies of recently swapped adapters' copy sources under a byte budget, least recently used out first.

    `sources` is called on the worker thread; adapters may die on any thread, so the bookkeeping is locked.
    """

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        if budget_bytes < 0:
            raise ValueError(f"a device adapter budget of {budget_bytes} bytes is negative")
        self.budget_bytes = budget_bytes
        self.device = device
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _HotAdapter] = OrderedDict()  # by id() of the live adapter
        self.hits = 0
        self.misses = 0

    def sources(self, adapter: CanonicalAdapter, host_sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """What to copy `adapter` into the slot from: its device copies (made now on a first use), or `host_sources`
        unchanged when they do not fit in the budget at all.

        The device copies are queued with non_blocking on the current stream; whoever copies from them must
        order its copy after that (HotswapSlot's copy stream waits for the current stream).
        """
        nbytes = _nbytes(host_sources)
        if nbytes > self.budget_bytes:
            return host_sources
        key = id(adapter)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.adapter() is adapter:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry.sources
            self.misses += 1
            self._entries.pop(key, None)
            used = sum(held.nbytes for held in self._entries.values())
            while self._entries and used + nbytes > self.budget_bytes:
                used -= self._entries.popitem(last=False)[1].nbytes
        try:
            copies = [torch.empty(source.shape, dtype=source.dtype, device=self.device) for source in host_sources]
        except torch.cuda.OutOfMemoryError:  # the denoiser's activations come first: copy from the host this time
            return host_sources
        torch._foreach_copy_(copies, host_sources, non_blocking=True)
        reference = weakref.ref(adapter, lambda gone, key=key: self._forget(key, gone))
        with self._lock:
            self._entries[key] = _HotAdapter(adapter=reference, sources=copies, nbytes=nbytes)
        return copies

    def _forget(self, key: int, reference: weakref.ref) -> None:
        """An adapter died: drop its copies (unless its id already names a newer adapter's)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.adapter is reference:
                del self._entries[key]

    def holds(self, adapter: CanonicalAdapter) -> bool:
        """Whether `adapter`'s copies are on the device now."""
        with self._lock:
            entry = self._entries.get(id(adapter))
            return entry is not None and entry.adapter() is adapter

    @property
    def used_bytes(self) -> int:
        """Bytes the hot set's device copies take now."""
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
