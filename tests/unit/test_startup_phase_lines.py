"""Start-up logs each phase as it begins and as it ends, and each warm-up pass as it begins, so that the last line of
a start-up that never finishes says where it was (two GPU runs of --quantize fp8 stopped with no phase line at all)."""

from __future__ import annotations

import logging

import pytest

from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import StartupStopped
from loraswap.server.engine.pipeline.startup import StartupStop, start_runtime

STARTUP_LOGGER = "loraswap.server.engine.pipeline.startup"


def _phase_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [record for record in records if record.name == STARTUP_LOGGER and hasattr(record, "phase")]


def _events(records: list[logging.LogRecord]) -> list[tuple[str, str]]:
    return [(record.phase, record.event) for record in _phase_records(records)]


def test_each_phase_begins_before_it_ends_and_each_warm_up_pass_is_announced(caplog) -> None:
    config = EngineConfig(model="tiny-flux", max_rank=4, compile=False, quantize="int8wo", torch_threads=1)
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        start_runtime(config)
    events = _events(caplog.records)
    passes = [record for record in _phase_records(caplog.records) if record.event == "step"]
    assert passes and all(record.phase == "warm-up" for record in passes)
    assert events == [
        ("load", "begins"), ("load", "done"), ("slot", "begins"), ("slot", "done"),
        ("quantize", "begins"), ("quantize", "done"),  # uncompiled: no compile lines
        ("warm-up", "begins"), *[("warm-up", "step")] * len(passes), ("warm-up", "done"),
    ]  # fmt: skip
    messages = [record.getMessage() for record in passes]
    assert all(f"pass {i} of {len(passes)} begins: rank bucket 0, " in m for i, m in enumerate(messages, 1)), messages
    # seconds: how long the phase had run when the line was written.
    seconds = [record.seconds for record in _phase_records(caplog.records) if record.phase == "warm-up"]
    assert seconds[0] == 0.0 and seconds == sorted(seconds)


def test_a_compiled_start_up_logs_the_compile_phase_and_a_pass_per_bucket_and_request(caplog) -> None:
    config = EngineConfig(
        model="tiny-flux", max_rank=4, rank_buckets=(4,), compile="full", compile_backend="eager", torch_threads=1
    )
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        start_runtime(config)
    events = _events(caplog.records)
    assert events[4:7] == [("compile", "begins"), ("compile", "step"), ("compile", "done")]
    passes = [record.getMessage() for record in _phase_records(caplog.records) if record.phase == "warm-up"][1:-1]
    # Compiled, the warm-up runs at every rank bucket (the base model's 0 and 4 under --fuse auto on the CPU, or
    # fewer when auto's rule never runs 4 unfused): each bucket's passes say which bucket.
    buckets = sorted({int(message.split("rank bucket ")[1].split(",")[0]) for message in passes})
    assert buckets[0] == 0 and len(passes) % len(buckets) == 0
    assert all(f" of {len(passes)} begins" in message for message in passes)


def test_a_stopped_start_up_ends_on_the_line_of_where_it_was(caplog) -> None:
    stop = StartupStop()

    class StopAtFirstPass(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) == "step":
                stop.request()

    handler = StopAtFirstPass()
    logging.getLogger(STARTUP_LOGGER).addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER), pytest.raises(StartupStopped) as stopped:
            start_runtime(EngineConfig(model="tiny-flux", max_rank=4, compile=False, torch_threads=1), stop)
    finally:
        logging.getLogger(STARTUP_LOGGER).removeHandler(handler)
    assert stopped.value.phase == "warm-up"
    last = _phase_records(caplog.records)[-1]
    assert (last.phase, last.event) == ("warm-up", "step") and "pass 1 of " in last.getMessage()
