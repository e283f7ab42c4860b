"""A model of the HAProxy front's placement, to choose its knobs over many hash rings instead of one.

benchmarks/scaleout.py measures the real thing, but on one ring: three replicas' points and 30 adapter names
fixed, so whether one replica happens to own most of the popular adapters decides much of its result. This
replays the same closed loop (`--clients` always in flight, `--requests` drawn Zipf over `--adapters`,
replicas serving one call at a time in arrival order, a cold load adding to a call's time) against HAProxy's
placement arithmetic: `balance hdr(lora)` on a consistent-hash ring (16 points per unit of weight, the key's
nearest point, then onwards along the ring), `hash-balance-factor`'s eligibility test (lb_chash.c,
chash_server_is_eligible: the open calls plus the new one times the factor, rounded up, shared out by weight),
and the hot-adapter rule of deploy/haproxy/haproxy.cfg (an adapter with at least `--hot-min-calls` of the last
calls, out of at least `--busy-calls`, and more than `--hot-share` of them, goes to the replica with the
fewest open calls, ties at random). Ring points and adapter names are random per ring, so this is a model of
a ring, not HAProxy's own hash of these names; every replica stays usable (none down or drained), and the hot
rule counts the last `--window` calls (by default all of them: a run is shorter than HAProxy's 60 s period,
whose rate decays over the period before). It prints one JSON object per policy: over `--rings` rings,
how often both scale-out targets (loads_over_ideal <= 1.2, max_replica_share_over_mean <= 1.25) were met, and
the median and 90th percentile of each figure.

    python -m benchmarks.scaleout_model                       # the shipped policy against the bound alone
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass

from benchmarks.queue_policy import zipf_sequence
from benchmarks.scaleout import add_workload_arguments

RING_SPACE = 2**32
POINTS_PER_WEIGHT = 16  # HAProxy's BE_WEIGHT_SCALE: ring points per unit of weight


def eligible_slots(open_calls: int, factor: int, server: int, servers: int) -> int:
    """HAProxy's bound for equal weights: how many open calls `server` (0-based, in file order) may hold before a
    new call, when `open_calls` are open in the backend."""
    total = ((open_calls + 1) * factor + 99) // 100
    per_server, remainder = divmod(total, servers)
    slots = per_server + ((server + 1) * remainder) // servers - (server * remainder) // servers
    return max(slots, 1)


@dataclass(frozen=True)
class Policy:
    name: str
    factor: int
    hot_share: float | None = None  # None: no hot-adapter rule
    hot_min_calls: int = 10
    busy_calls: int = 20


class Ring:
    def __init__(self, servers: int, weight: int, rng: random.Random) -> None:
        points = sorted(
            (rng.randrange(RING_SPACE), s) for s in range(servers) for _ in range(weight * POINTS_PER_WEIGHT)
        )
        self.keys = [key for key, _ in points]
        self.owners = [owner for _, owner in points]

    def place(self, key: int, eligible) -> int:
        """The nearest point's server (HAProxy takes the closer of the points around the key), or the first
        eligible one after it along the ring."""
        count = len(self.keys)
        after = bisect.bisect_left(self.keys, key) % count
        before = (after - 1) % count
        start = before if (key - self.keys[before]) % RING_SPACE <= (self.keys[after] - key) % RING_SPACE else after
        for step in range(count):
            server = self.owners[(start + step) % count]
            if eligible(server):
                return server
        return self.owners[start]


def run_ring(policy: Policy, args, ring_seed: int) -> tuple[float, float]:
    """(loads_over_ideal, max_replica_share_over_mean) of one closed-loop run on one random ring."""
    rng = random.Random(ring_seed)
    ring = Ring(args.replicas, args.weight, rng)
    adapter_keys = [rng.randrange(RING_SPACE) for _ in range(args.adapters)]
    sequence = zipf_sequence(args.requests, args.adapters, args.zipf, ring_seed)
    open_calls = [0] * args.replicas
    busy_until = [0.0] * args.replicas
    held = [set() for _ in range(args.replicas)]
    taken = [0] * args.replicas
    recent: deque[int] = deque(maxlen=args.window)
    finishing: list[tuple[float, int]] = []
    pending = deque(sequence)

    def send(now: float) -> None:
        if not pending:
            return
        adapter = pending.popleft()
        recent.append(adapter)
        mine = recent.count(adapter)
        hot = (
            policy.hot_share is not None
            and len(recent) >= policy.busy_calls
            and mine >= policy.hot_min_calls
            and mine > policy.hot_share * len(recent)
        )
        if hot:
            fewest = min(open_calls)
            server = rng.choice([s for s in range(args.replicas) if open_calls[s] == fewest])
        else:
            total = sum(open_calls)
            server = ring.place(
                adapter_keys[adapter],
                lambda s: policy.factor == 0 or open_calls[s] < eligible_slots(total, policy.factor, s, args.replicas),
            )
        open_calls[server] += 1
        taken[server] += 1
        cost = args.call_time * rng.uniform(0.95, 1.05)
        if adapter not in held[server]:
            held[server].add(adapter)
            cost += args.load_time
        busy_until[server] = max(now, busy_until[server]) + cost
        heapq.heappush(finishing, (busy_until[server], server))

    for _ in range(args.clients):
        send(0.0)
    while finishing:
        now, server = heapq.heappop(finishing)
        open_calls[server] -= 1
        send(now)
    loads = sum(len(adapters) for adapters in held)
    return loads / len(set(sequence)), max(taken) / statistics.fmean(taken)


def summarise(policy: Policy, args) -> dict:
    figures = [run_ring(policy, args, seed) for seed in range(args.rings)]
    loads = sorted(f[0] for f in figures)
    shares = sorted(f[1] for f in figures)

    def at(values: list[float], fraction: float) -> float:
        return round(values[min(len(values) - 1, int(fraction * len(values)))], 3)

    return {
        "policy": policy.name,
        "hash_balance_factor": policy.factor,
        "hot_share": policy.hot_share,
        "rings": args.rings,
        "both_targets_met": round(sum(l <= 1.2 and s <= 1.25 for l, s in figures) / len(figures), 3),
        "loads_over_ideal": {"median": round(statistics.median(loads), 3), "p90": at(loads, 0.9)},
        "max_replica_share_over_mean": {"median": round(statistics.median(shares), 3), "p90": at(shares, 0.9)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaleout_model", description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--weight", type=int, default=100)
    parser.add_argument("--rings", type=int, default=60, help="random rings (and request sequences) per policy")
    parser.add_argument("--call-time", type=float, default=1.0, help="a call's time on its replica")
    parser.add_argument("--load-time", type=float, default=0.3, help="added by a cold load, in call times")
    parser.add_argument("--window", type=int, default=1000, help="calls the hot rule's shares count over")
    parser.add_argument("--factors", default="200,250,300", help="bound-alone factors to compare")
    args = parser.parse_args(argv)
    hot_share = 2 / (5 * args.replicas)
    policies = [Policy(f"bound alone, factor {f}", int(f)) for f in args.factors.split(",")]
    policies += [Policy(f"hot rule + factor {f}", f, hot_share) for f in (275, 300)]
    policies += [Policy("hot rule 1/(2N) + factor 300", 300, 1 / (2 * args.replicas))]
    for policy in policies:
        print(json.dumps(summarise(policy, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
