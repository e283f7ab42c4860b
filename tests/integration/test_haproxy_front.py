"""Several replicas behind HAProxy (deploy/haproxy/haproxy.cfg, rendered by deploy/haproxy/front.py).

Real `loraswap serve` processes on ports the OS picks, a real HAProxy 2.6 in front
(HTTP/2 end to end, active gRPC health checks, `balance hdr(lora)` with consistent
hashing under a balance factor), real channels to the front.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import grpc
import pytest
from deploy.haproxy.front import LocalFront

from loraswap.client import GeneratedImage, LoraswapClient, Progress
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

if shutil.which("haproxy") is None:
    if os.environ.get("CI"):
        raise RuntimeError("haproxy is missing in CI: .ci/run must install it (apt-get install haproxy)")
    pytest.skip("haproxy is not installed here (.ci/run installs it: apt-get install haproxy)", allow_module_level=True)

PROMPT = "a red circle on a blue background"
SERVE_FLAGS = ["--no-compile", "--torch-threads", "1", "--log-level", "WARNING", "--grace-seconds", "30"]


@pytest.fixture(scope="module")
def front():
    with LocalFront(replicas=2, serve_flags=SERVE_FLAGS, ready_timeout=300) as running:
        yield running


def _cached_on(front: LocalFront) -> dict[str, set[str]]:
    """replica address -> adapters it holds, asked of each replica directly."""
    held = {}
    for replica in front.started:
        if replica.process.poll() is not None:
            continue
        with grpc.insecure_channel(replica.address) as channel:
            listing = pb_grpc.DiffusionServiceStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=10)
        held[replica.address] = {adapter.id for adapter in listing.adapters}
    return held


def test_generate_streams_every_step_through_the_front(front) -> None:
    with LoraswapClient(front.address, default_timeout=120) as client:
        events = list(client.generate(PROMPT, adapter="outline", seed=3, num_inference_steps=6))
    steps = [event.step for event in events if isinstance(event, Progress)]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert isinstance(events[-1], GeneratedImage) and events[-1].width == 64


def test_requests_naming_one_adapter_land_on_one_replica(front) -> None:
    with grpc.insecure_channel(front.address) as channel:
        stub = pb_grpc.DiffusionServiceStub(channel)
        for adapter in ("swap-colors", "purple"):
            for seed in range(3):
                request = pb.GenerateRequest(prompt=PROMPT, adapter=adapter, seed=seed, num_inference_steps=1)
                responses = list(stub.Generate(request, metadata=[("lora", adapter)], timeout=120))
                assert responses[-1].WhichOneof("event") == "image"
    held = _cached_on(front)
    for adapter in ("swap-colors", "purple"):
        holders = [address for address, names in held.items() if adapter in names]
        assert len(holders) == 1, f"{adapter} was loaded on {holders}"


def test_a_replica_drained_with_sigterm_finishes_its_call_and_leaves_the_rotation(front) -> None:
    """Two long calls (one per replica, round-robin); SIGTERM one replica: both complete, it goes DOWN in
    HAProxy while it drains, and new calls through the front then all succeed on the other one."""
    results: list[object] = []

    def long_call() -> None:
        try:
            with LoraswapClient(front.address, default_timeout=120) as client:
                results.append(client.generate_image(PROMPT, seed=9, num_inference_steps=120))
        except Exception as error:  # noqa: BLE001 - recorded and asserted on below
            results.append(error)

    callers = [threading.Thread(target=long_call) for _ in range(2)]
    for caller in callers:
        caller.start()
    time.sleep(1.5)  # both calls are running, one on each replica
    drained = front.started[0]
    drained.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not front.server_states().get("replica1", "").startswith("DOWN"):
        assert time.monotonic() < deadline, f"haproxy still routes to the draining replica: {front.server_states()}"
        time.sleep(0.1)
    assert drained.process.poll() is None, "the replica should still be draining its running call"
    with LoraswapClient(front.address, default_timeout=120) as client:
        for seed in range(4):
            assert client.generate_image(PROMPT, seed=seed, num_inference_steps=1).width == 64
    for caller in callers:
        caller.join(120)
    assert [type(result).__name__ for result in results] == ["GeneratedImage", "GeneratedImage"], results
    assert drained.process.wait(60) == 0


def test_scaleout_benchmark_prints_its_figures(capsys) -> None:
    from benchmarks import scaleout

    assert (
        scaleout.main(["--replicas", "2", "--requests", "12", "--clients", "3", "--adapters", "4", "--steps", "1"]) == 0
    )
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for run in (figures, figures["round_robin"]):
        assert run["requests"] == 12 and sum(run["requests_per_replica"]) == 12
        assert run["distinct_adapters"] <= run["adapter_loads"] <= 2 * run["distinct_adapters"]
        assert {"loads_over_ideal", "max_replica_share_over_mean", "p50_ms", "p99_ms"} <= set(run)
    assert figures["round_robin"]["balance"] == "roundrobin"
