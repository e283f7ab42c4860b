"""Several replicas behind HAProxy: adapter affinity under bounded load against plain round-robin.

Starts `--replicas` replicas of the `shapes` model behind HAProxy (deploy/haproxy/front.py,
loopback only), sends `--requests` Generates from `--clients` concurrent clients over
`--adapters` adapters drawn Zipf(`--zipf`) through loraswap's own client (which names each
adapter in the `lora` metadata HAProxy hashes on), and prints one JSON object: adapter loads
summed over the replicas (from each replica's ListAdapters) against the ideal of one load per
distinct adapter, the busiest replica's share of requests over the mean (from HAProxy's
counters), and latency percentiles; then the same workload under plain `balance roundrobin` (no
hot-adapter rule either) for comparison. Bounded in count, and every call in time.

`--kill-replica` measures instead what the fleet does when a replica dies: the same
clients, in a closed loop bounded in time, on the shipped config; `kill -9` of the
replica with the most calls open, its restart into the same slot of the front
`--down-seconds` later, and one JSON object under `kill_replica`: which calls failed
and whether each had reached the killed replica (HAProxy's log line of each call, by
its x-request-id), how soon the front stopped routing to it, latencies before, during
and after, and whether it took its adapters back.

    python -m benchmarks.scaleout                                  # 3 replicas, 300 requests, 8 clients
    python -m benchmarks.scaleout --requests 60 --adapters 10      # a quick look
    python -m benchmarks.scaleout --kill-replica                   # 10 + 20 s, kill, 10 s down, restart, 20 s
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from benchmarks.queue_policy import percentile, zipf_sequence

PROMPT = "a red circle on a blue background"


def write_adapters(directory: Path, count: int) -> list[str]:
    """`count` adapter folders, copies of the shipped shapes adapters under distinct names."""
    from loraswap.server.engine.models import builtin_model

    shipped = sorted(p for p in builtin_model("shapes").adapter_dir.iterdir() if p.is_dir())
    names = []
    for index in range(count):
        name = f"a{index:03d}"
        shutil.copytree(shipped[index % len(shipped)], directory / name)
        names.append(name)
    return names


async def drive(address: str, sequence: list[str], clients: int, steps: int, timeout: float) -> list[float]:
    """Send the sequence from `clients` concurrent clients, each on its own channel and sending the `lora`
    metadata as every loraswap client does; returns each request's latency in ms."""
    from loraswap.client import AsyncLoraswapClient

    pending = list(enumerate(sequence))
    latencies: list[float] = []

    async def client_loop() -> None:
        async with AsyncLoraswapClient(address, default_timeout=timeout) as client:
            while pending:
                seed, adapter = pending.pop(0)
                started = time.perf_counter()
                await client.generate_image(PROMPT, adapter=adapter, seed=seed, num_inference_steps=steps)
                latencies.append((time.perf_counter() - started) * 1000.0)

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return latencies


def replica_figures(front) -> tuple[dict[str, int], list[int]]:
    """(adapter -> how many replicas hold it; requests each replica served) after a run."""
    import grpc

    from loraswap.v1 import diffusion_service_pb2 as pb
    from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

    holders: dict[str, int] = {}
    for replica in front.started:
        with grpc.insecure_channel(replica.address) as channel:
            listing = pb_grpc.DiffusionServiceStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        for adapter in listing.adapters:
            holders[adapter.id] = holders.get(adapter.id, 0) + 1
    served = [int(row["stot"]) for row in front.server_stats().values()]  # the calls each replica took
    return holders, served


def run_front(args, adapter_dir: Path, sequence: list[str], balance: str) -> dict:
    from deploy.haproxy.front import LocalFront

    flags = [
        "--model", "shapes", "--adapter-dir", str(adapter_dir), "--no-compile", "--torch-threads", "1",
        "--log-level", "WARNING", "--max-queue", str(len(sequence)),
    ]  # fmt: skip
    # Plain round-robin for comparison: without the hot-adapter rule too, which would steer the popular adapters.
    hot_adapters = balance != "roundrobin"
    front = LocalFront(
        replicas=args.replicas,
        serve_flags=flags,
        balance=balance,
        balance_factor=args.balance_factor,
        hot_adapters=hot_adapters,
    )
    with front:
        started = time.perf_counter()
        latencies = asyncio.run(drive(front.address, sequence, args.clients, args.steps, args.timeout))
        elapsed = time.perf_counter() - started
        holders, served = replica_figures(front)
    loads = sum(holders.values())
    distinct = len(set(sequence))
    requests = {name: sequence.count(name) for name in holders}
    mean = statistics.fmean(served)
    return {
        "balance": balance,
        "balance_factor": args.balance_factor,
        "hot_adapters": hot_adapters,
        "replicas": args.replicas,
        "requests": len(sequence),
        "distinct_adapters": distinct,
        "adapter_loads": loads,
        "loads_over_ideal": round(loads / distinct, 3),
        "requests_per_replica": served,
        # adapter -> [its requests, replicas holding it], for those held by more than one
        "held_by_several": {name: [requests[name], count] for name, count in sorted(holders.items()) if count > 1},
        "max_replica_share_over_mean": round(max(served) / mean, 3),
        "p50_ms": round(percentile(latencies, 0.5), 1),
        "p99_ms": round(percentile(latencies, 0.99), 1),
        "seconds": round(elapsed, 1),
    }


@dataclass
class Call:
    """One Generate, as its client saw it (times: time.monotonic())."""

    request_id: str  # sent as x-request-id: HAProxy logs it, the replica echoes it
    adapter: str
    started: float = 0.0
    ended: float = 0.0
    code: str = "OK"  # the gRPC status name; NO_IMAGE for a stream that ended OK without an image
    details: str = ""
    messages: int = 0  # responses received (0: none had come when it ended)

    @property
    def ms(self) -> float:
        return (self.ended - self.started) * 1000.0


def _client_channel(address: str):
    """A channel with the loraswap client's options (keepalive; the service config's retry of UNAVAILABLE, which
    gRPC applies only to a call that has had no answer yet) and a connection of its own (gRPC otherwise shares
    one among channels with the same options)."""
    import grpc

    from loraswap.client.connection import client_channel_options

    return grpc.aio.insecure_channel(
        address, options=[*client_channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    )


async def _generate(stub, call: Call, steps: int, timeout: float, seed: int) -> None:
    """Send `call` as a Generate on `stub` and read it to its end, noting in `call` how it went. Metadata: `lora`
    as the loraswap client sends it, and the x-request-id (the loraswap client has no parameter for it)."""
    import grpc

    from loraswap.client.connection import LORA_METADATA_KEY
    from loraswap.v1 import diffusion_service_pb2 as pb

    request = pb.GenerateRequest(prompt=PROMPT, adapter=call.adapter, seed=seed, num_inference_steps=steps)
    metadata = ((LORA_METADATA_KEY, call.adapter), ("x-request-id", call.request_id))
    call.started = time.monotonic()
    last = None
    try:
        async for last in stub.Generate(request, timeout=timeout, wait_for_ready=True, metadata=metadata):
            call.messages += 1
        if last is None or last.WhichOneof("event") != "image":
            call.code = "NO_IMAGE"
    except grpc.RpcError as error:
        call.code, call.details = error.code().name, error.details() or ""
    call.ended = time.monotonic()


async def closed_loop(
    address: str, adapters: Iterator[str], clients: int, steps: int, timeout: float, stop: asyncio.Event
) -> list[Call]:
    """`clients` closed-loop clients, one connection each, send Generates for the next adapter of `adapters` until
    `stop` is set (each finishes the call it is in); returns every call, in the order they started."""
    from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

    calls: list[Call] = []

    async def client_loop() -> None:
        async with _client_channel(address) as channel:
            stub = pb_grpc.DiffusionServiceStub(channel)
            while not stop.is_set():
                call = Call(request_id=uuid.uuid4().hex, adapter=next(adapters))
                calls.append(call)
                await _generate(stub, call, steps, timeout, seed=len(calls))

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return calls


async def one_by_one(address: str, adapters: list[str], steps: int, timeout: float) -> list[Call]:
    """One Generate for each of `adapters`, each after the last has ended."""
    from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

    calls = []
    async with _client_channel(address) as channel:
        stub = pb_grpc.DiffusionServiceStub(channel)
        for seed, adapter in enumerate(adapters):
            calls.append(Call(request_id=uuid.uuid4().hex, adapter=adapter))
            await _generate(stub, calls[-1], steps, timeout, seed)
    return calls


class ServerSample(NamedTuple):
    """One replica's row of HAProxy's `show stat` at one moment."""

    status: str  # UP, DOWN, ...
    taken: int  # stot: every call HAProxy sent it or tried to (a refused connection, then redispatched, too)
    open: int  # scur: calls open on it


class ServerWatch(threading.Thread):
    """Samples every replica's row of HAProxy's `show stat` every `period` seconds into `samples`:
    (time.monotonic(), replicaN -> ServerSample)."""

    def __init__(self, front, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.front, self.period = front, period
        self.samples: list[tuple[float, dict[str, ServerSample]]] = []
        self._sampled = threading.Condition()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            rows = self.front.server_stats().items()
            sample = {
                name: ServerSample(row["status"], int(row["stot"] or 0), int(row["scur"] or 0)) for name, row in rows
            }
            with self._sampled:
                self.samples.append((time.monotonic(), sample))
                self._sampled.notify_all()
            self._done.wait(self.period)

    def next_sample(self, timeout: float = 10.0) -> dict[str, ServerSample]:
        """The first sample taken after this call."""
        with self._sampled:
            count = len(self.samples)
            if not self._sampled.wait_for(lambda: len(self.samples) > count, timeout):
                raise TimeoutError(f"no sample of haproxy's servers in {timeout} s")
            return self.samples[-1][1]

    def series(self, name: str) -> list[tuple[float, ServerSample]]:
        return [(at, sample[name]) for at, sample in self.samples if name in sample]

    def stop(self) -> None:
        self._done.set()
        self.join()


@dataclass
class ReplicaLoss:
    """What a replica-loss run observed (times: time.monotonic()); kill_replica_figures sums it up."""

    victim: str  # the killed replica's slot in the front: replicaN
    measured_from: float  # the end of the warm-up: latencies "before" are of calls started from then on
    open_at_kill: int  # the calls HAProxy had open on it at the last sample before the kill (show stat, scur)
    killed_at: float
    restart_at: float  # when its new process was started
    rejoined_at: float | None  # when HAProxy saw it up again; None if it never did
    calls: list[Call]  # the closed loop's
    samples: list[tuple[float, ServerSample]]  # ServerWatch's of the victim, from before the kill to the loop's end
    loads_before: dict[str, list[str]]  # replicaN -> adapters it held just before the kill (ListAdapters)
    probes: list[Call] = field(default_factory=list)  # after the loop: one call for each of its ring adapters
    log: list = field(default_factory=list)  # FrontLogLine: HAProxy's line of every call and probe
    loads_after: dict[str, list[str]] = field(default_factory=dict)  # ... at the end


def held_adapters(front) -> dict[str, list[str]]:
    """replicaN -> the adapters it holds, asked of each running replica directly."""
    import grpc

    from loraswap.v1 import diffusion_service_pb2 as pb
    from loraswap.v1 import diffusion_service_pb2_grpc as pb_grpc

    held = {}
    for index, replica in enumerate(front.started):
        if replica.process.poll() is not None:
            continue
        with grpc.insecure_channel(replica.address) as channel:
            listing = pb_grpc.DiffusionServiceStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        held[f"replica{index + 1}"] = sorted(adapter.id for adapter in listing.adapters)
    return held


def ring_adapters(calls: list[Call], log: list, victim: str, before: float) -> list[str]:
    """The adapters the front placed on `victim` by its ring: every call for them that started before `before`
    went there, none sent by the hot-adapter rule (HAProxy's log says which)."""
    lines = {line.request_id: line for line in log}
    placed: dict[str, set[str]] = collections.defaultdict(set)
    for call in calls:
        if call.started < before and call.request_id in lines:
            line = lines[call.request_id]
            placed[call.adapter].add(f"hot:{line.steered_to}" if line.steered_to else line.server)
    return sorted(adapter for adapter, servers in placed.items() if servers == {victim})


def wait_for_log_lines(front, calls: list[Call], timeout: float = 10.0) -> list:
    """HAProxy's log once it holds a line for each of `calls` (it writes one as a call ends), or at `timeout`."""
    wanted = {call.request_id for call in calls}
    deadline = time.monotonic() + timeout
    while True:
        log = front.request_log()
        if wanted <= {line.request_id for line in log} or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


async def lose_a_replica(
    front, adapters: Iterator[str], *, clients: int, steps: int, timeout: float, before_s: float, down_s: float,
    after_s: float, warmup_s: float = 0.0,
) -> ReplicaLoss:  # fmt: skip
    """Run the closed loop on `front` for `warmup_s` then `before_s`, `kill -9` the replica with the most calls
    open, start it again into its slot `down_s` later, run `after_s` more once HAProxy sees it up and stop the
    loop; then send one call for each adapter the ring had placed on it, one at a time, and read HAProxy's log."""
    stop = asyncio.Event()
    loop = asyncio.create_task(closed_loop(front.address, adapters, clients, steps, timeout, stop))
    await asyncio.sleep(warmup_s)
    measured_from = time.monotonic()
    await asyncio.sleep(before_s)
    watch = ServerWatch(front)
    watch.start()
    loads_before = await asyncio.to_thread(held_adapters, front)
    open_calls = {name: sample.open for name, sample in (await asyncio.to_thread(watch.next_sample)).items()}
    victim = max(sorted(open_calls), key=open_calls.get)
    index = int(victim.removeprefix("replica")) - 1
    killed_at = time.monotonic()
    front.kill_replica(index)
    await asyncio.sleep(down_s)
    restart_at = time.monotonic()
    rejoined_at = None
    try:
        await asyncio.to_thread(front.restart_replica, index)
        rejoined_at = time.monotonic()
        await asyncio.sleep(after_s)
    finally:
        stop.set()
        calls = await loop
        watch.stop()
    loss = ReplicaLoss(
        victim=victim,
        measured_from=measured_from,
        open_at_kill=open_calls[victim],
        killed_at=killed_at,
        restart_at=restart_at,
        rejoined_at=rejoined_at,
        calls=calls,
        samples=watch.series(victim),
        loads_before=loads_before,
    )
    if rejoined_at is not None:
        log = await asyncio.to_thread(wait_for_log_lines, front, calls)
        loss.probes = await one_by_one(front.address, ring_adapters(calls, log, victim, killed_at), steps, timeout)
    loss.log = await asyncio.to_thread(wait_for_log_lines, front, calls + loss.probes)
    loss.loads_after = await asyncio.to_thread(held_adapters, front)
    return loss


def _routing_figures(loss: ReplicaLoss) -> dict:
    """How soon the front stopped sending calls to the victim, from ServerWatch's samples up to its restart: when
    HAProxy marked it DOWN, and the last sample at which its count of calls taken (stot: tries on a dead
    replica, refused and redispatched, included) had grown. Times from the kill, to the 50 ms of the sampling."""
    series = [(at - loss.killed_at, s.status, s.taken) for at, s in loss.samples if at < loss.restart_at]
    after_kill = [(at, status, taken) for at, status, taken in series if at >= 0]
    if not after_kill:
        return {"marked_down_s": None, "reroute_s": None, "routed_after_kill": None, "routed_after_down": None}
    at_kill = next((taken for at, _, taken in reversed(series) if at < 0), after_kill[0][2])
    routed = [at for (_, _, before), (at, _, taken) in itertools.pairwise(series) if at >= 0 and taken > before]
    down = next(((at, taken) for at, status, taken in after_kill if status.startswith("DOWN")), None)
    return {
        "marked_down_s": None if down is None else round(down[0], 3),
        "reroute_s": None if down is None else round(max([down[0], *routed]), 3),
        "routed_after_kill": after_kill[-1][2] - at_kill,
        "routed_after_down": None if down is None else after_kill[-1][2] - down[1],
    }


def lines_on_victim(loss: ReplicaLoss) -> dict[str, list]:
    """request id -> HAProxy's lines of that call that name the victim with a connection made to it (Tc >= 0),
    so that its request was sent there; only calls that have one."""
    lines = collections.defaultdict(list)
    for line in loss.log:
        if line.server == loss.victim and line.reached_server:
            lines[line.request_id].append(line)
    return dict(lines)


def in_flight_at_kill(loss: ReplicaLoss) -> list[Call]:
    """The calls in flight on the victim at the kill: open at their client then (started before, ended after) and
    sent to the victim by HAProxy's log. Whether a call failed plays no part, so a failure of any other call
    counts in `failed_not_in_flight`."""
    on_victim = lines_on_victim(loss)
    return [c for c in loss.calls if c.started < loss.killed_at < c.ended and c.request_id in on_victim]


def kill_replica_figures(loss: ReplicaLoss) -> dict:
    """The replica-loss figures; BENCHMARKS.md says how each is measured."""
    lines = collections.defaultdict(list)
    for line in loss.log:
        lines[line.request_id].append(line)
    killed_at, victim = loss.killed_at, loss.victim
    on_victim = lines_on_victim(loss)
    flying = in_flight_at_kill(loss)
    in_flight = {call.request_id for call in flying}
    failed = [call for call in loss.calls if call.code != "OK"]
    rejoined_at = loss.rejoined_at if loss.rejoined_at is not None else float("inf")
    served_after = [
        call for call in loss.calls + loss.probes
        if call.started >= rejoined_at and call.code == "OK" and call.request_id in on_victim
    ]  # fmt: skip
    ring = {probe.adapter for probe in loss.probes}
    back = [
        probe for probe in loss.probes
        if probe.code == "OK" and [(line.server, line.steered_to) for line in lines[probe.request_id]] == [(victim, "")]
    ]  # fmt: skip
    moved = {
        adapter
        for name, held in loss.loads_after.items()
        if name != victim
        for adapter in ring & (set(held) - set(loss.loads_before.get(name, ())))
    }
    figures = {
        "victim": victim,
        "victim_open_calls_at_kill": loss.open_at_kill,
        "calls": len(loss.calls),
        "calls_failed": len(failed),
        "in_flight_at_kill": len(flying),
        "in_flight_failed": sum(call.code != "OK" for call in flying),
        "in_flight_ok": sum(call.code == "OK" for call in flying),
        "failed_not_in_flight": sum(call.request_id not in in_flight for call in failed),
        "failed_by_status": dict(collections.Counter(f"{call.code}: {call.details}" for call in failed)),
        "in_flight_terminations": dict(
            collections.Counter(line.termination for call in flying for line in on_victim[call.request_id])
        ),
        "in_flight_failed_within_s": round(max((c.ended - killed_at for c in flying if c.code != "OK"), default=0), 3),
        **_routing_figures(loss),
        "redispatched": sum(line.redispatched for line in loss.log),
        "rejoined": loss.rejoined_at is not None and bool(served_after),
        "rejoined_s": None if loss.rejoined_at is None else round(loss.rejoined_at - killed_at, 1),
        "restart_to_up_s": None if loss.rejoined_at is None else round(loss.rejoined_at - loss.restart_at, 1),
        "served_after_rejoining": len(served_after),
        "victim_ring_adapters": len(ring),
        "victim_ring_adapters_back": len(back),
        # Probes the hot-adapter rule sent to the least busy replica instead: adapters hot by then.
        "victim_ring_adapters_steered": sum(any(line.steered_to for line in lines[p.request_id]) for p in loss.probes),
        "victim_ring_adapters_loaded_elsewhere": len(moved),
    }
    phases = {
        "before": lambda call: loss.measured_from <= call.started < killed_at,
        "during": lambda call: killed_at <= call.started < rejoined_at,
        "after": lambda call: call.started >= rejoined_at,
    }
    for phase, within in phases.items():
        latencies = [call.ms for call in loss.calls if call.code == "OK" and within(call)]
        figures[f"calls_{phase}"] = len(latencies)
        figures[f"p50_ms_{phase}"] = round(percentile(latencies, 0.5), 1) if latencies else None
        figures[f"p99_ms_{phase}"] = round(percentile(latencies, 0.99), 1) if latencies else None
    figures["loads_before"] = {name: len(held) for name, held in sorted(loss.loads_before.items())}
    figures["loads_after"] = {name: len(held) for name, held in sorted(loss.loads_after.items())}
    return figures


def run_kill_replica(args, adapter_dir: Path, names: list[str]) -> dict:
    from deploy.haproxy.front import LocalFront

    # A fixed budget for --fuse auto's pristine copies (shapes': 4.7 MB): by default it is the memory free beyond a
    # fifth of the machine's, and a replica restarted while a busy machine had less refused to start.
    flags = [
        "--model", "shapes", "--adapter-dir", str(adapter_dir), "--no-compile", "--torch-threads", "1",
        "--log-level", "WARNING", "--max-queue", str(4 * args.clients), "--fuse-memory-bytes", str(64 * 2**20),
    ]  # fmt: skip
    # An endless Zipf stream: the loop is bounded in time, not count.
    draws = zipf_sequence(100_000, args.adapters, args.zipf, args.seed)
    adapters = (names[index] for index in itertools.cycle(draws))
    with LocalFront(replicas=args.replicas, serve_flags=flags) as front:
        loss = asyncio.run(
            lose_a_replica(
                front, adapters, clients=args.clients, steps=args.steps, timeout=args.timeout,
                before_s=args.before_seconds, down_s=args.down_seconds, after_s=args.after_seconds,
                warmup_s=args.warmup_seconds,
            )
        )  # fmt: skip
    shape = ("replicas", "clients", "adapters", "zipf", "steps", "warmup_seconds", "before_seconds", "down_seconds")
    workload = {name: getattr(args, name) for name in (*shape, "after_seconds")}
    return {**workload, **kill_replica_figures(loss)}


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's shape, shared with benchmarks/scaleout_model.py: replicas, and requests from closed-loop
    clients over adapters drawn Zipf."""
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=30)
    parser.add_argument("--zipf", type=float, default=1.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each call, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance-factor", type=int, default=None, help="hash-balance-factor (default: the config's)")
    parser.add_argument(
        "--kill-replica", action="store_true", help="kill -9 a replica mid-loop and restart it (not --requests)"
    )
    parser.add_argument(
        "--warmup-seconds", type=float, default=10.0, help="--kill-replica: loop before the latencies count"
    )
    parser.add_argument("--before-seconds", type=float, default=20.0, help="--kill-replica: then loop until the kill")
    parser.add_argument("--down-seconds", type=float, default=10.0, help="--kill-replica: from the kill to the restart")
    parser.add_argument("--after-seconds", type=float, default=20.0, help="--kill-replica: loop once it is up again")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loraswap-scaleout-") as tmp:
        adapter_dir = Path(tmp)
        names = write_adapters(adapter_dir, args.adapters)
        if args.kill_replica:
            print(json.dumps({"kill_replica": run_kill_replica(args, adapter_dir, names)}))
            return 0
        sequence = [names[i] for i in zipf_sequence(args.requests, args.adapters, args.zipf, args.seed)]
        affinity = run_front(args, adapter_dir, sequence, "hdr(lora)")
        round_robin = run_front(args, adapter_dir, sequence, "roundrobin")
    print(json.dumps({**affinity, "round_robin": round_robin}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
