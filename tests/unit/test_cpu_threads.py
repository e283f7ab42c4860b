"""torch's CPU threads: an explicit --torch-threads stays, unset is the usable cores for good (same bits whatever
the load), and 0 gives up the cores others take."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loraswap.server.engine.pipeline.cpu_threads import (
    ADJUST_INTERVAL_S,
    CoreShare,
    FixedThreads,
    thread_policy,
    usable_cores,
)
from tests.support.servers import TEST_TORCH_THREADS


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    torch.set_num_threads(TEST_TORCH_THREADS)


def test_explicit_threads_are_kept() -> None:
    policy = thread_policy(3)
    assert isinstance(policy, FixedThreads)
    assert torch.get_num_threads() == 3 and policy.adjust() == 3


def test_unset_threads_are_the_usable_cores_for_good() -> None:
    policy = thread_policy(None)
    assert isinstance(policy, FixedThreads)
    assert policy.threads == usable_cores() == torch.get_num_threads() == policy.adjust()


def test_zero_threads_follow_the_load_starting_at_the_usable_cores() -> None:
    policy = thread_policy(0)
    assert isinstance(policy, CoreShare)
    assert policy.threads == usable_cores() == torch.get_num_threads()


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the load is read from /proc")
def test_threads_give_up_the_cores_other_processes_keep_busy() -> None:
    """With every usable core kept busy by another process, the server runs one thread."""
    policy = CoreShare(max_threads=4)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    try:
        time.sleep(0.3)  # the loops get going
        ends_at = time.monotonic() + 10
        while policy.adjust() != 1 and time.monotonic() < ends_at:
            time.sleep(ADJUST_INTERVAL_S)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert policy.threads == 1 == torch.get_num_threads()
