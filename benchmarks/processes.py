"""Child processes of the benchmarks (servers they start): one way to see them serve and one to stop them.
No torch here."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

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


def wait_for_serving_line(process: subprocess.Popen, timeout: float) -> tuple[int, float] | None:
    """Read a `loraswap serve` process's stdout (text) until its "serving ... on port N" line: (N, the
    time.perf_counter() it was read at), or None when it did not come within `timeout` seconds."""
    found: dict[str, float] = {}

    def read() -> None:
        for line in process.stdout:
            if "serving" in line and "on port" in line:
                found["at"] = time.perf_counter()
                found["port"] = int(line.rsplit("on port", 1)[1].split()[0].strip(" ,"))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if "port" not in found:
        return None
    return int(found["port"]), found["at"]
