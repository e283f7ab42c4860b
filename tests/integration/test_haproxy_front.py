"""Several replicas behind HAProxy (deploy/haproxy/haproxy.cfg, rendered by deploy/haproxy/front.py).

Real `loraswap serve` processes on ports the OS picks, a real HAProxy 2.6 in front
(HTTP/2 end to end, active gRPC health checks, `balance hdr(lora)` with consistent
hashing under a balance factor), real channels to the front. What happens on a
replica is observed on that replica: the calls HAProxy counts for it, the adapters
it holds, and how long a request sent straight to it waits in its queue.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from deploy.haproxy.front import CONFIG, FACTOR_LINE, LocalFront

from loraswap.client import GeneratedImage, LoraswapClient, Progress
from loraswap.v1 import diffusion_service_pb2 as pb
from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

if shutil.which("haproxy") is None:
    if os.environ.get("CI"):
        raise RuntimeError("haproxy is missing in CI: .ci/run must install it (apt-get install haproxy)")
    pytest.skip("haproxy is not installed here (.ci/run installs it: apt-get install haproxy)", allow_module_level=True)

PROMPT = "a red circle on a blue background"
SERVE_FLAGS = ["--no-compile", "--torch-threads", "1", "--log-level", "WARNING", "--grace-seconds", "30"]
# Long enough that a generation left running would hold its replica for many seconds (the most steps a request
# may ask for, at 192x192, where a step of the shapes model on one thread costs about 2.25 times its 30-110 ms at
# 128x128): a call that should have stopped but did not is unmistakable. At 128x128 a quiet two-core machine ran
# 200 steps in 6 s, too few for the deadline test's margin (five times two steps and SLACK_MS left after 1.5 s).
LONG_STEPS = 200
LONG_SIZE = 192
# What a busy two-core machine may add to "within a step": scheduling, the proxy hop, the next call's set-up.
SLACK_MS = 750.0
# Each test names its own adapters (copies of the shipped ones), so what one replica holds is that test's doing.
ADAPTERS = ("outline", "purple", "swap-colors", "hot", "popular", "cancelled", "deadline", "streamed")
# The shipped rule's thresholds: an adapter is hot from its 10th call in 60 s, once the backend took 20.
HOT_AFTER_CALLS = 10
BACKEND_BUSY_CALLS = 20


def _shipped_adapters() -> Path:
    """The shapes model's adapters, found without importing the server (and torch) into the test process."""
    package = importlib.util.find_spec("loraswap.server").submodule_search_locations[0]
    return Path(package) / "engine" / "models" / "shapes_weights" / "adapters"


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    adapter_dir = tmp_path_factory.mktemp("adapters")
    shipped = sorted(path for path in _shipped_adapters().iterdir() if path.is_dir())
    for index, name in enumerate(ADAPTERS):
        source = next((path for path in shipped if path.name == name), shipped[index % len(shipped)])
        shutil.copytree(source, adapter_dir / name)
    # Four replicas: the shipped balance factor (300% of the mean) binds from four on; with three, one replica
    # may hold every open call, so nothing would ever spill on the bound alone.
    flags = [*SERVE_FLAGS, "--adapter-dir", str(adapter_dir)]
    # pytest's folder for the front's config and logs: kept after a failing test (pytest keeps the last runs').
    workdir = tmp_path_factory.mktemp("front")
    with LocalFront(replicas=4, serve_flags=flags, ready_timeout=300, workdir=workdir) as running:
        yield running


def _request(adapter: str, steps: int, seed: int = 0) -> pb.GenerateRequest:
    """A Generate; a long one (LONG_STEPS) also at LONG_SIZE, so that it holds its replica for long."""
    size = {"width": LONG_SIZE, "height": LONG_SIZE} if steps == LONG_STEPS else {}
    return pb.GenerateRequest(prompt=PROMPT, adapter=adapter, seed=seed, num_inference_steps=steps, **size)


def _lora(adapter: str) -> list[tuple[str, str]]:
    return [("lora", adapter)]


def _calls_now(front: LocalFront) -> dict[str, int]:
    """replica name -> calls HAProxy has open on it now."""
    return {name: int(row["scur"] or 0) for name, row in front.server_stats().items()}


def _calls_taken(front: LocalFront) -> dict[str, int]:
    """replica name -> calls HAProxy has sent it so far."""
    return {name: int(row["stot"] or 0) for name, row in front.server_stats().items()}


def _replica_that_took_one_more(front: LocalFront, before: dict[str, int]) -> int:
    """The index (0-based, as in front.started) of the one replica HAProxy sent one call since `before`."""
    after = _calls_taken(front)
    took = [name for name in after if after[name] > before.get(name, 0)]
    assert len(took) == 1, f"expected one replica to take the call: {before} -> {after}"
    return int(took[0].removeprefix("replica")) - 1


def _wait_until_no_call_is_open(front: LocalFront) -> None:
    """Until the calls an earlier test cancelled have ended on their replicas (within a step each)."""
    deadline = time.monotonic() + 30
    while any((now := _calls_now(front)).values()):
        assert time.monotonic() < deadline, f"cancelled calls still open: {now}"
        time.sleep(0.05)


def _make_hot(front: LocalFront, adapter: str) -> None:
    """BACKEND_BUSY_CALLS short calls for `adapter`, one at a time: it is then hot for the front's rule (at
    least HOT_AFTER_CALLS of its own among at least BACKEND_BUSY_CALLS in the last 60 s, well over 2/(5N))."""
    _wait_until_no_call_is_open(front)
    front.wait_until_up(timeout=60)  # all four in the rotation (see the spill test)
    with grpc.insecure_channel(front.address) as channel:
        stub = pb_grpc.DiffusionServiceStub(channel)
        for seed in range(BACKEND_BUSY_CALLS):
            responses = list(stub.Generate(_request(adapter, 1, seed), metadata=_lora(adapter), timeout=120))
            assert responses[-1].WhichOneof("event") == "image"
    _wait_until_no_call_is_open(front)


def _open_long_calls(front: LocalFront, stub, adapter: str, count: int, calls: list) -> dict[str, int]:
    """Open `count` long calls for `adapter` one by one, each once the last has reached a replica (so the front
    sees it when it places the next); they go into `calls` (the caller cancels them). Returns the open calls
    per replica at the end."""
    for seed in range(count):
        before = sum(_calls_now(front).values())
        calls.append(stub.Generate(_request(adapter, LONG_STEPS, seed), metadata=_lora(adapter), timeout=120))
        deadline = time.monotonic() + 30
        while sum((now := _calls_now(front)).values()) < before + 1:
            assert time.monotonic() < deadline, (
                f"the call did not reach a replica: {now}; HAProxy sees {front.server_states()}"
            )
            time.sleep(0.02)
    return now


def _step_ms(progress: list[pb.Progress]) -> float:
    return max(event.elapsed_ms / event.step for event in progress)


def _direct_generate(front: LocalFront, index: int, adapter: str, seed: int) -> tuple[list[pb.GenerateResponse], float]:
    """A short Generate sent straight to replica `index`: its responses and how long it took (ms)."""
    started = time.perf_counter()
    with front.replica_channel(index) as channel:
        responses = list(pb_grpc.DiffusionServiceStub(channel).Generate(_request(adapter, 2, seed), timeout=120))
    return responses, (time.perf_counter() - started) * 1000.0


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


def test_queued_and_progress_events_stream_through_the_front_as_they_happen(front) -> None:
    """Queued arrives while the call still waits (not held back until it runs), then every step, spread over
    the generation as it happens (HAProxy does not buffer the stream)."""
    before = _calls_taken(front)
    with grpc.insecure_channel(front.address) as channel:
        list(pb_grpc.DiffusionServiceStub(channel).Generate(_request("streamed", 1), metadata=_lora("streamed")))
    index = _replica_that_took_one_more(front, before)
    steps = 30
    with front.replica_channel(index) as direct, grpc.insecure_channel(front.address) as channel:
        holder = pb_grpc.DiffusionServiceStub(direct).Generate(_request("", LONG_STEPS), timeout=120)
        next(response for response in holder if response.WhichOneof("event") == "progress")  # the worker runs it
        call = pb_grpc.DiffusionServiceStub(channel).Generate(
            _request("streamed", steps), metadata=_lora("streamed"), timeout=120
        )
        started = time.perf_counter()
        first = next(call)
        assert first.WhichOneof("event") == "queued" and first.queued.position == 1, first
        assert time.perf_counter() - started < 5, "the Queued event was held back"
        holder.cancel()
        arrivals = [(response, time.perf_counter()) for response in call]
    progress = [(response.progress, at) for response, at in arrivals if response.WhichOneof("event") == "progress"]
    assert [event.step for event, _ in progress] == list(range(1, steps + 1))
    assert arrivals[-1][0].WhichOneof("event") == "image"
    generated_s = (progress[-1][0].elapsed_ms - progress[0][0].elapsed_ms) / 1000.0
    assert progress[-1][1] - progress[0][1] > 0.5 * generated_s > 0, "progress arrived in a burst, not as it happened"


def test_a_hot_adapter_spills_to_a_second_replica_once_the_first_is_over_its_bound(front) -> None:
    """Calls for one adapter, opened one by one and held open (each queues behind the first on its replica):
    they stay on the adapter's replica while it is within hash-balance-factor% of the mean of outstanding
    calls, the first call beyond that bound goes to another replica, and that replica then holds the adapter.
    All within fewer calls than make an adapter hot, so the bound alone decides (the next test is the hot rule)."""
    factor = int(FACTOR_LINE.search(CONFIG.read_text()).group(0).split()[-1])
    replicas = len(front.started)
    assert factor < 100 * replicas, f"with hash-balance-factor {factor} one of {replicas} replicas never fills"
    calls = []
    placements: list[tuple[str, int, int]] = []  # (replica that took the call, calls open on the first, all open)
    # Every replica up and idle first: on a busy machine a health check can miss its 2 s once (fall 1), and a
    # replica coming back up takes two passed checks; the placements below assume all four in the rotation.
    _wait_until_no_call_is_open(front)
    front.wait_until_up(timeout=60)
    try:
        with grpc.insecure_channel(front.address) as channel:
            stub = pb_grpc.DiffusionServiceStub(channel)
            for seed in range(4 * replicas):
                before = _calls_now(front)
                open_calls = sum(before.values())
                calls.append(stub.Generate(_request("hot", LONG_STEPS, seed), metadata=_lora("hot"), timeout=120))
                deadline = time.monotonic() + 30
                while sum((now := _calls_now(front)).values()) < open_calls + 1:
                    assert time.monotonic() < deadline, (
                        f"the call did not reach a replica: {now}; HAProxy sees {front.server_states()}"
                    )
                    time.sleep(0.02)
                took = next(name for name in now if now[name] > before.get(name, 0))
                first = placements[0][0] if placements else took
                placements.append((took, before.get(first, 0), open_calls))
                if took != first:
                    break
                assert len(placements) < HOT_AFTER_CALLS - 1, f"no spill before the hot rule applies: {placements}"
            first = placements[0][0]
            assert placements[-1][0] != first, f"a hot adapter never left its replica: {placements}"
            # HAProxy's bound: the open calls (with the new one) times the factor, shared over the replicas.
            for took, on_first, open_calls in placements:
                slots = math.ceil((open_calls + 1) * factor / 100) / replicas
                if took == first:
                    assert on_first < math.ceil(slots), f"stayed beyond its bound: {placements}"
                else:
                    assert on_first >= math.floor(slots), f"spilled within its bound: {placements}"
            second = int(placements[-1][0].removeprefix("replica")) - 1
            deadline = time.monotonic() + 30
            while "hot" not in _cached_on(front).get(front.started[second].address, set()):
                assert time.monotonic() < deadline, f"the second replica never loaded the hot adapter: {placements}"
                time.sleep(0.1)
    finally:
        for call in calls:
            call.cancel()
    holders = sorted(address for address, names in _cached_on(front).items() if "hot" in names)
    assert holders == sorted(front.started[int(name.removeprefix("replica")) - 1].address
                             for name in {placements[0][0], placements[-1][0]})  # fmt: skip


def test_a_hot_adapter_goes_to_the_least_busy_replica_and_ends_up_on_every_one(front) -> None:
    """Once one adapter takes most of the recent calls (past HOT_AFTER_CALLS of its own and BACKEND_BUSY_CALLS
    in all), each of its calls goes to the replica with the fewest calls open: long calls opened one by one fill
    every replica evenly, two each, where the ring and its bound would have stacked them on the adapter's replica
    up to 300% of the mean (without the rule this test saw [6, 2, 0, 0] open calls), and every replica
    then holds the adapter."""
    _make_hot(front, "popular")
    replicas = len(front.started)
    with grpc.insecure_channel(front.address) as channel:
        calls = []
        try:
            now = _open_long_calls(front, pb_grpc.DiffusionServiceStub(channel), "popular", 2 * replicas, calls)
            assert sorted(now.values()) == [2] * replicas, f"hot calls were not spread by open calls: {now}"
            deadline = time.monotonic() + 30
            while len(holders := [a for a, names in _cached_on(front).items() if "popular" in names]) < replicas:
                assert time.monotonic() < deadline, f"the hot adapter is held by {holders} only"
                time.sleep(0.1)
        finally:
            for call in calls:
                call.cancel()
    _wait_until_no_call_is_open(front)


def test_a_hot_adapter_avoids_a_replica_an_operator_set_to_weight_0(front) -> None:
    """`set weight loraswap_replicas/replicaN 0` on HAProxy's runtime API takes a replica out for the hot rule
    too (the README's operator drain): hot calls opened one by one fill the other replicas and never it."""
    _make_hot(front, "popular")
    replicas = len(front.started)
    front.runtime_api("set weight loraswap_replicas/replica2 0")
    try:
        with grpc.insecure_channel(front.address) as channel:
            calls = []
            try:
                now = _open_long_calls(front, pb_grpc.DiffusionServiceStub(channel), "popular", replicas - 1, calls)
                assert now["replica2"] == 0 and sorted(now.values()) == [0] + [1] * (replicas - 1), now
            finally:
                for call in calls:
                    call.cancel()
    finally:
        front.runtime_api("set weight loraswap_replicas/replica2 100")
    _wait_until_no_call_is_open(front)


def test_a_client_cancel_through_the_front_stops_the_generation_on_its_replica_within_a_step(front) -> None:
    """Cancel a long call through the front; a call sent straight to the same replica, queued behind it, then
    starts within about a step, not after the abandoned one's remaining steps."""
    before = _calls_taken(front)
    with grpc.insecure_channel(front.address) as channel:
        call = pb_grpc.DiffusionServiceStub(channel).Generate(
            _request("cancelled", LONG_STEPS), metadata=_lora("cancelled"), timeout=120
        )
        progress = []
        for response in call:
            if response.WhichOneof("event") == "progress":
                progress.append(response.progress)
                if response.progress.step >= 3:
                    break
        index = _replica_that_took_one_more(front, before)
        step_ms = _step_ms(progress)
        with front.replica_channel(index) as direct:
            follower = pb_grpc.DiffusionServiceStub(direct).Generate(_request("cancelled", 2, seed=1), timeout=120)
            assert next(follower).WhichOneof("event") == "queued"  # it waits behind the long call
            call.cancel()
            cancelled_at = time.perf_counter()
            responses = list(follower)
        waited_ms = (time.perf_counter() - cancelled_at) * 1000.0
    timings = responses[-1].image.timings
    own_ms = timings.total_ms - timings.queue_ms  # the follower's own work, after it left the queue
    allowed_ms = 2 * step_ms + SLACK_MS
    remaining_ms = (LONG_STEPS - progress[-1].step) * step_ms
    assert remaining_ms > 5 * allowed_ms, "the abandoned call is too short for this test to tell anything"
    assert waited_ms - own_ms < allowed_ms, (waited_ms, own_ms, step_ms)
    assert call.code() == grpc.StatusCode.CANCELLED


def test_a_deadline_through_the_front_ends_with_deadline_exceeded_and_the_replica_stops(front) -> None:
    before = _calls_taken(front)
    progress = []
    with grpc.insecure_channel(front.address) as channel:
        stub = pb_grpc.DiffusionServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            for response in stub.Generate(_request("deadline", LONG_STEPS), metadata=_lora("deadline"), timeout=1.5):
                if response.WhichOneof("event") == "progress":
                    progress.append(response.progress)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    index = _replica_that_took_one_more(front, before)
    step_ms = _step_ms(progress)
    allowed_ms = 2 * step_ms + SLACK_MS
    assert (LONG_STEPS - progress[-1].step) * step_ms > 5 * allowed_ms, "too short a call to tell anything"
    responses, _ = _direct_generate(front, index, "deadline", seed=2)
    assert responses[-1].WhichOneof("event") == "image"
    # The replica's worker was free again within about a step of the deadline.
    assert responses[-1].image.timings.queue_ms < allowed_ms, (responses[-1].image.timings, step_ms)


def test_a_replica_drained_with_sigterm_finishes_its_call_and_leaves_the_rotation(front) -> None:
    """Two long calls through the front; SIGTERM a replica running one: both complete, it goes DOWN in HAProxy
    while it drains, and new calls through the front all succeed elsewhere. Runs last on this module's front."""
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
    deadline = time.monotonic() + 20
    while sum((now := _calls_now(front)).values()) < 2:
        assert time.monotonic() < deadline, f"the long calls did not reach the replicas: {now}"
        time.sleep(0.05)
    name = next(name for name, calls in now.items() if calls)
    drained = front.started[int(name.removeprefix("replica")) - 1]
    drained.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not front.server_states().get(name, "").startswith("DOWN"):
        assert time.monotonic() < deadline, f"haproxy still routes to the draining replica: {front.server_states()}"
        time.sleep(0.1)
    assert drained.process.poll() is None, "the replica should still be draining its running call"
    taken_by_drained = _calls_taken(front)[name]
    with LoraswapClient(front.address, default_timeout=120) as client:
        for seed in range(4):
            assert client.generate_image(PROMPT, seed=seed, num_inference_steps=1).width == 64
        assert client.generate_image(PROMPT, adapter="outline", num_inference_steps=1).width == 64
    assert _calls_taken(front)[name] == taken_by_drained, "a new call went to the draining replica"
    for caller in callers:
        caller.join(120)
    assert [type(result).__name__ for result in results] == ["GeneratedImage", "GeneratedImage"], results
    assert drained.process.wait(60) == 0


def test_scaleout_benchmark_prints_its_figures(capsys, monkeypatch) -> None:
    """Also: the fronts it starts and stops cleanly leave no working folder behind (configs, logs, sockets),
    looked for in a temporary directory of this test's own (short: HAProxy's socket path has 97 characters)."""
    from benchmarks import scaleout

    own_tmp = Path(tempfile.mkdtemp(prefix="scaleout-"))
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    assert (
        scaleout.main(["--replicas", "2", "--requests", "12", "--clients", "3", "--adapters", "4", "--steps", "1"]) == 0
    )
    assert list(own_tmp.iterdir()) == []
    own_tmp.rmdir()
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for run in (figures, figures["round_robin"]):
        assert run["requests"] == 12 and sum(run["requests_per_replica"]) == 12
        assert run["distinct_adapters"] <= run["adapter_loads"] <= 2 * run["distinct_adapters"]
        assert {"loads_over_ideal", "max_replica_share_over_mean", "p50_ms", "p99_ms"} <= set(run)
    assert figures["round_robin"]["balance"] == "roundrobin"
