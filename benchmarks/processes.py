"""Child processes of the benchmarks (servers they start): one way to stop them. No torch here."""

from __future__ import annotations

import signal
import subprocess

STOP_TIMEOUT_S = 60


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then kill if it is still running after STOP_TIMEOUT_S."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
