"""A replica killed with calls in flight, behind the real HAProxy front (deploy/haproxy, rendered by front.py).

Three `loraswap serve` processes of `shapes` on ports the OS picks, HAProxy 2.6 in front, closed-loop clients
(benchmarks/scaleout.py's, each call with its own x-request-id); `kill -9` of the replica with the most calls
open, then its restart into the same slot of the front. Which replica each call reached is read from HAProxy's
log line for its request id, not guessed from timing; how soon the front stops routing to the dead replica from
HAProxy's counters for it, sampled every 50 ms.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil

import pytest
from benchmarks.scaleout import in_flight_at_kill, kill_replica_figures, lines_on_victim, lose_a_replica, write_adapters
from deploy.haproxy.front import CONFIG, LocalFront

if shutil.which("haproxy") is None:
    if os.environ.get("CI"):
        raise RuntimeError("haproxy is missing in CI: .ci/run must install it (apt-get install haproxy)")
    pytest.skip("haproxy is not installed here (.ci/run installs it: apt-get install haproxy)", allow_module_level=True)

# The health check's period and how many failed checks take a replica out, as the shipped file says.
CHECKS = re.search(r"default-server check inter (\d+)s fall (\d+)", CONFIG.read_text())
INTER_S, FALL = int(CHECKS.group(1)), int(CHECKS.group(2))
# What a busy two-core machine may add: a check that runs late, the poll of HAProxy's counters, the event loop.
SLACK_S = 1.0
# Twelve adapters used in turn: each takes 1/12 of the calls, under the hot-adapter rule's 2/(5N) = 2/15, so
# every adapter stays where the ring puts it and the ring's return can be checked adapter by adapter.
ADAPTERS = 12
FUSE_MEMORY_BYTES = 64 * 2**20


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapters")
    write_adapters(directory, ADAPTERS)
    return directory


@pytest.fixture(scope="module")
def front(tmp_path_factory, adapter_dir):
    flags = ["--model", "shapes", "--adapter-dir", str(adapter_dir), "--no-compile", "--torch-threads", "1"]
    # A fixed budget for --fuse auto's pristine copies (shapes': 4.7 MB): by default it is the memory free beyond
    # a fifth of the machine's, and a replica restarted on a busy shared machine found none and refused to start.
    flags += ["--log-level", "WARNING", "--fuse-memory-bytes", str(FUSE_MEMORY_BYTES)]
    # pytest's folder for the front's config and logs: kept after a failing test (pytest keeps the last runs').
    workdir = tmp_path_factory.mktemp("front")
    with LocalFront(replicas=3, serve_flags=flags, ready_timeout=300, workdir=workdir) as running:
        yield running


def test_a_replica_killed_mid_stream_fails_only_its_own_calls_and_comes_back_to_its_adapters(
    front, adapter_dir
) -> None:
    """kill -9 of the busiest replica under a closed loop: each call in flight on it fails promptly (within the
    check period + a second); no other call fails, those sent after the kill among them; the front stops
    routing to it within inter x fall; restarted into its slot, it is SERVING, up in HAProxy, and each adapter
    the ring had placed on it goes to it again."""
    adapters = itertools.cycle(sorted(path.name for path in adapter_dir.iterdir()))
    loss = asyncio.run(
        lose_a_replica(front, adapters, clients=4, steps=2, timeout=60, before_s=3.0, down_s=2.5, after_s=2.0)
    )
    figures = kill_replica_figures(loss)
    flying = in_flight_at_kill(loss)
    on_victim = lines_on_victim(loss)
    assert any(call.code != "OK" for call in flying), f"the kill caught no call on {loss.victim}: {figures}"
    for call in flying:
        if call.code == "OK":
            # Only a call the replica had answered in full before it died (the end still on its way to the client).
            assert [line.termination for line in on_victim[call.request_id]] == ["----"], (call, figures)
            continue
        assert call.ended - loss.killed_at <= INTER_S + 1.0, (call, figures)
        # HAProxy 2.6 ends a stream that had its answer's headers with an empty END_STREAM frame and no
        # grpc-status (gRPC: UNKNOWN), one that had none with RST_STREAM(REFUSED_STREAM) (gRPC: UNAVAILABLE).
        # The headers may have come before any whole message (seen once in CI: UNKNOWN after 0 messages).
        answered = call.code == "UNKNOWN" and "END_STREAM" in call.details
        assert answered or (call.messages == 0 and call.code == "UNAVAILABLE"), call
    assert figures["failed_not_in_flight"] == 0, figures
    assert figures["calls_during"] >= 4, f"too few calls ran while the replica was down to tell anything: {figures}"
    # Out of rotation within inter x fall, and no call sent to it (or tried on it) after that.
    assert figures["reroute_s"] is not None and figures["reroute_s"] <= INTER_S * FALL + SLACK_S, figures
    assert figures["routed_after_down"] == 0, figures
    # Back in its slot: serving calls again, its adapters on the ring with it.
    assert figures["rejoined"], figures
    assert figures["victim_ring_adapters"] >= 1, f"the ring placed no adapter on {loss.victim}: {figures}"
    assert figures["victim_ring_adapters_back"] == figures["victim_ring_adapters"], figures
