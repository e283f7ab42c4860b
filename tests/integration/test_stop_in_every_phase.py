"""SIGTERM or SIGINT at any moment of `loraswap serve`'s life ends it cleanly.

A real `serve` process gets a stop signal in each phase of its life: before it listens, while it loads, puts
the slot in, compiles, warms up (compiled with the eager backend, whose warm-up takes tens of seconds here), while it
serves with a queue, and while it drains. Each must end with its documented exit code (0) and last log line,
within a bound, and never with torch's C++ abort: a stop during warm-up used to end, one time in two, with
`terminate called without an active exception` and SIGABRT (the worker thread was still inside torch when the
interpreter finalized; scheduler.py says how that aborts).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraswap.client import GeneratedImage, Queued
from tests.support.servers import TEST_TORCH_THREADS
from tests.support.streams import generate_in_background

# Compiled models whose phases last long enough to be hit. tiny-sdxl: load ~3 s, slot (with its pristine copies)
# and compile under a second each. tiny-flux: a warm-up of a minute or more, whose steps (a stop is seen at the
# next one) compile faster than tiny-sdxl's. The grace is long, so that each case ends the clean way; the pristine
# copies' budget is fixed, since by default it follows what memory the machine's other processes leave.
SERVE_FLAGS = ("--grace-seconds", "60", "--fuse-memory-bytes", str(64 * 2**20))
# eager: dynamo still traces every warm-up graph (the worker is inside torch all along), in half aot_eager's time.
COMPILED_SDXL = ("--model", "tiny-sdxl", "--compile", "--compile-backend", "eager", *SERVE_FLAGS)
COMPILED_FLUX = ("--model", "tiny-flux", "--compile", "--compile-backend", "eager", *SERVE_FLAGS)
# What a stop may take from its signal to the exit: the phase's next stopping point (one graph's compile at worst,
# a minute on a busy two-core machine), then the interpreter's exit (seconds). That a stop cuts its phase short is
# asserted by the log line that never comes (StopCase.never), not by the clock.
STOP_BOUND_S = 90.0
START_BOUND_S = 120.0
# A serve takes one core (one torch thread); this machine and CI have two.
CONCURRENT_SERVES = 2
ABORTED = re.compile(r"terminate called|Fatal Python error|core dumped|Traceback")


class ServeProcess:
    """A `loraswap serve` subprocess whose output (stdout and stderr, in order) is read line by line as it comes."""

    def __init__(self, *flags: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "loraswap.client.command", "serve", "--host", "127.0.0.1", "--port", "0", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "LORASWAP_TORCH_THREADS": str(TEST_TORCH_THREADS)},
        )
        self.lines: list[str] = []
        self.signalled_at: float | None = None
        self._incoming: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._incoming.put(line.rstrip("\n"))
        self._incoming.put(None)

    def wait_for(self, pattern: str, timeout: float = START_BOUND_S) -> re.Match:
        """The first line from now on that matches `pattern`."""
        ends_at = time.monotonic() + timeout
        while (left := ends_at - time.monotonic()) > 0:
            try:
                line = self._incoming.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"serve exited before {pattern!r}:\n{self.output}")
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no {pattern!r} within {timeout:g} s:\n{self.output}")

    def wait_until_importing_torch(self, timeout: float = START_BOUND_S) -> None:
        """Until torch's library is mapped: serve is importing it (it does so first thing), seconds before it listens."""
        ends_at = time.monotonic() + timeout
        maps = Path(f"/proc/{self.process.pid}/maps")
        while "libtorch" not in maps.read_text():
            assert time.monotonic() < ends_at, f"serve did not import torch within {timeout:g} s"
            time.sleep(0.01)

    def send(self, sig: signal.Signals) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
        self.process.send_signal(sig)

    def finish(self, timeout: float = STOP_BOUND_S) -> tuple[int, float]:
        """Read to the end; the exit status and the seconds from the first signal to the exit."""
        ends_at = time.monotonic() + timeout
        while True:
            try:
                line = self._incoming.get(timeout=max(0.0, ends_at - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"serve still running {timeout:g} s after the signal:\n{self.output}") from None
            if line is None:
                break
            self.lines.append(line)
        returncode = self.process.wait(timeout=max(1.0, ends_at - time.monotonic()))
        return returncode, time.monotonic() - (self.signalled_at or ends_at - timeout)

    @property
    def output(self) -> str:
        return "\n".join(self.lines[-40:])

    @property
    def last_line(self) -> str:
        return next((line for line in reversed(self.lines) if line.strip()), "")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def assert_clean_exit(serve: ServeProcess, returncode: int, last_line: str) -> None:
    """Exit 0, `last_line` last, no abort."""
    assert not ABORTED.search("\n".join(serve.lines)), serve.output
    # Negative: ended by a signal (-6 is the abort); 0 is the documented exit of every stop.
    assert returncode == 0, f"exit status {returncode}:\n{serve.output}"
    assert re.search(last_line, serve.last_line), serve.output


@dataclass(frozen=True)
class StopCase:
    """Where a stop comes: after which output line (None: while serve imports torch) and how long after; the last
    line it must end with, and a line it must never reach (a pattern: the end of the phase it stops)."""

    after: str | None
    delay_s: float
    sig: signal.Signals
    last_line: str
    never: str
    flags: tuple[str, ...] = COMPILED_SDXL


def _phase_done(phase: str) -> str:
    # The line a phase ends with ("start-up load: 2.31 s, ..."), not the ones it begins or steps with.
    return rf"start-up {re.escape(phase)}: \d+\.\d+ s, "


def _stopped_in(*phases: str) -> str:
    # A phase that lasts under a second may be over when the signal lands: the stop then names a later one.
    return rf"INFO loraswap\.server\.app: stopped during start-up \(phase ({'|'.join(phases)})\)$"


def _in_warm_up(delay_s: float, sig: signal.Signals, last_line: str = _stopped_in("warm-up"), *flags: str) -> StopCase:
    return StopCase(_phase_done("compile"), delay_s, sig, last_line, _phase_done("warm-up"), (*COMPILED_FLUX, *flags))


START_UP_CASES = {
    "before-listening": StopCase(None, 0.0, signal.SIGTERM, r"loraswap serve: stopped before listening$", "port"),
    "load": StopCase(r"listening on port", 0.0, signal.SIGTERM, _stopped_in("load"), _phase_done("slot")),
    "slot": StopCase(_phase_done("load"), 0.0, signal.SIGINT, _stopped_in("slot", "compile", "warm-up"), "ready:"),
    "compile": StopCase(_phase_done("slot"), 0.0, signal.SIGTERM, _stopped_in("compile", "warm-up"), "ready:"),
    # It aborted one time in two before (the worker inside torch while Python finalized); SIGINT here, SIGTERM in
    # the other phases. Each phase's stop is one more serve process: the default run keeps one try per phase.
    "warm-up": _in_warm_up(2.0, signal.SIGINT),
    # Past the grace the worker is still inside torch: the process leaves without finalizing, still exit 0.
    "warm-up-past-the-grace": _in_warm_up(
        1.0,
        signal.SIGTERM,
        r"WARNING loraswap\.server\.app: stopped during start-up without waiting for the engine: its worker was "
        r"still busy in start-up phase warm-up after 0 s$",
        "--grace-seconds",
        "0",
    ),
}


def _stop_in(case: StopCase) -> tuple[ServeProcess, int, float]:
    """Run `serve` until `case` says, signal it, read it to its end: (it, its exit status, the stop's seconds)."""
    serve = ServeProcess(*case.flags)
    try:
        if case.after is None:
            serve.wait_until_importing_torch()
        else:
            serve.wait_for(case.after)
        time.sleep(case.delay_s)
        serve.send(case.sig)
        returncode, seconds = serve.finish()
    finally:
        serve.kill()
    return serve, returncode, seconds


@pytest.fixture(scope="module")
def start_up_stops(request: pytest.FixtureRequest) -> Iterator[dict[str, Future]]:
    """The selected start-up cases, CONCURRENT_SERVES at a time (each a serve of its own): name -> its _stop_in."""
    selected = [
        item.callspec.params["case_name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_a_stop_during_start_up_exits_0_with_its_last_line"
    ]
    with ThreadPoolExecutor(max_workers=CONCURRENT_SERVES) as pool:
        yield {name: pool.submit(_stop_in, START_UP_CASES[name]) for name in selected}


@pytest.mark.parametrize("case_name", START_UP_CASES)
def test_a_stop_during_start_up_exits_0_with_its_last_line(case_name: str, start_up_stops) -> None:
    case = START_UP_CASES[case_name]
    serve, returncode, seconds = start_up_stops[case_name].result()
    assert_clean_exit(serve, returncode, case.last_line)
    assert not any(re.search(case.never, line) for line in serve.lines), serve.output
    assert seconds < STOP_BOUND_S


# At 128x128 a tiny-flux step takes tens of ms here: a generation runs for seconds, long enough to signal in.
STREAM_SIZE = 128


def _wait_until(condition, what: str, timeout: float = 60.0) -> None:
    ends_at = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < ends_at, what
        time.sleep(0.01)


def test_a_stop_while_serving_a_queue_drains_and_a_second_signal_during_the_drain_ends_it():
    """SIGTERM with one generation running and two queued: the running one finishes (the drain); SIGINT while
    the next runs ends the drain at once, what is left failing with UNAVAILABLE (SHUTTING_DOWN); exit 0."""
    serve = ServeProcess("--model", "tiny-flux", "--no-compile", *SERVE_FLAGS)
    try:
        port = int(serve.wait_for(r"serving .* on port (\d+)").group(1))
        running_thread, running, running_started = generate_in_background(port, steps=60, seed=1, size=STREAM_SIZE)
        assert running_started.wait(60)
        queued = [generate_in_background(port, steps=100, seed=seed, size=STREAM_SIZE) for seed in (2, 3)]
        _wait_until(
            lambda: all(any(isinstance(e, Queued) and e.position for e in out["events"]) for _, out, _ in queued),
            "the two generations never queued",
        )
        assert running_thread.is_alive(), "the first generation ended before the stop"
        serve.send(signal.SIGTERM)
        serve.wait_for(r"stopping: draining for up to 60 s", timeout=30)
        running_thread.join(60)
        _wait_until(lambda: any(started.is_set() for _, _, started in queued), "the next generation never ran")
        serve.send(signal.SIGINT)
        returncode, seconds = serve.finish()
        for thread, _, _ in queued:
            thread.join(30)
    finally:
        serve.kill()
    assert_clean_exit(
        serve, returncode, r"INFO loraswap\.server\.app: stopped: the generations left failed with UNAVAILABLE"
    )
    assert isinstance(running["events"][-1], GeneratedImage), running
    assert "a second stop signal: not waiting any longer" in "\n".join(serve.lines)
    for _, outcome, _ in queued:
        error = outcome.get("error")
        assert error is not None and (error.code.name, error.reason) == ("UNAVAILABLE", "SHUTTING_DOWN"), outcome
    assert seconds < STOP_BOUND_S
