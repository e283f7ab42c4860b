"""How many torch threads a CPU server runs: a fixed count (the default), or as many as the cores others leave.

torch's CPU kernels split each operation across its OpenMP threads and wait for the
slowest. When another process keeps one of the cores busy, the thread that shares that
core runs in scheduler slices, and every operation waits for it: on 2 cores with one
taken, 2 threads ran the `shapes` model 4-5x slower than alone, while 1 thread would
have lost nothing. Passive OpenMP waiting does not help (the wait is for the preempted
thread, not the spinning one) and costs 3x alone.

But the thread count also decides how a kernel splits its sums, so the same request run
with another count can give an image whose last bits differ (measured: tiny-sdxl at 256 px,
tiny-flux and shapes at 512 px differ between 1, 2 and 4 threads). Users rely on "same
seed, same image", so by default (`--torch-threads` unset) the count is fixed at the usable
cores at start-up (`FixedThreads`), and an explicit `--torch-threads N` fixes it at N.

`--torch-threads 0` asks for the count to follow the load instead, for servers that share
their machine and value speed over bit-identical repeats: between denoising steps, at most
every ADJUST_INTERVAL_S, `CoreShare` reads how much CPU time the machine's usable cores
spent (/proc/stat) minus this process's own (/proc/self/stat) since the last look, and runs
torch with the cores that leaves free (at least 1, at most the usable cores). Two such
servers on one machine settle on a core each instead of fighting over both. Where /proc is
not there to read, the count stays at the usable cores. GetServerInfo.torch_threads says
which (0: following the load).
"""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)

ADJUST_INTERVAL_S = 0.1  # shortest window the load is judged over (ticks are 10 ms)
BUSY_THRESHOLD = 0.5  # others must use more than this much of a core before a thread gives it up


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within a cgroup CPU quota when one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]  # noqa: SIM115 - a one-line read
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _usable_cpu_ids() -> set[int] | None:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _machine_busy_ticks(cpus: set[int] | None) -> tuple[int, int] | None:
    """(busy ticks, all ticks) summed over the usable CPUs' /proc/stat lines; None when unreadable."""
    try:
        lines = open("/proc/stat").read().splitlines()  # noqa: SIM115 - a one-shot read
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        ticks = [int(value) for value in values[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def _own_ticks() -> int | None:
    """This process's user + system CPU ticks, all threads."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115 - a one-shot read
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


class CoreShare:
    """Keeps torch's thread count at the usable cores that other processes leave free (see the module docstring)."""

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self._cpus = _usable_cpu_ids()
        self._last: tuple[float, int, int, int] | None = None
        torch.set_num_threads(self.threads)
        self._sample(time.monotonic())

    def _sample(self, now: float) -> tuple[float, int, int, int] | None:
        machine, own = _machine_busy_ticks(self._cpus), _own_ticks()
        if machine is None or own is None:
            return None
        previous, self._last = self._last, (now, machine[0], machine[1], own)
        return previous

    def adjust(self) -> int:
        """Look at the load since the last look (if it is ADJUST_INTERVAL_S old) and set torch's threads; returns them.

        Call on the thread that runs torch: OpenMP keeps the count per calling thread.
        """
        now = time.monotonic()
        if self._last is None or now - self._last[0] < ADJUST_INTERVAL_S:
            return self.threads
        _, busy_before, total_before, own_before = self._last
        if self._sample(now) is None:
            return self.threads
        _, busy, total, own = self._last
        if total <= total_before:
            return self.threads
        cores = len(self._cpus) if self._cpus else self.max_threads
        # Core-seconds others used per second, over the usable CPUs (steal time counts: those cycles are gone).
        others = max(0.0, (busy - busy_before) - (own - own_before)) * cores / (total - total_before)
        # A core counts as taken once others use more than BUSY_THRESHOLD of it.
        free = cores - int(others + (1.0 - BUSY_THRESHOLD))
        threads = min(self.max_threads, max(1, free))
        if threads != self.threads:
            torch.set_num_threads(threads)
            log.debug("torch threads %d -> %d (others use %.2f cores)", self.threads, threads, others)
            self.threads = threads
        return self.threads


class FixedThreads:
    """An explicit --torch-threads: set once, never changed."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        torch.set_num_threads(threads)

    def adjust(self) -> int:
        return self.threads


# --torch-threads 0: follow the load (CoreShare).
FOLLOW_THE_LOAD = 0


def thread_policy(torch_threads: int | None) -> CoreShare | FixedThreads:
    """--torch-threads N: N threads for good; unset: the usable cores, for good; 0: as many as the usable cores others
    leave free (CoreShare)."""
    if torch_threads == FOLLOW_THE_LOAD:
        return CoreShare(usable_cores())
    return FixedThreads(torch_threads if torch_threads is not None else usable_cores())
