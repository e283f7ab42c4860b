"""End to end over gRPC: a real `loraswap serve` process, measured from a client process that runs no torch.

    python -m benchmarks.serve                                     # tiny-flux
    python -m benchmarks.serve --model random-sdxl --size 64 --steps 2 --mix-requests 24
    python -m benchmarks.serve --fuse                              # shapes: --fuse never / always / auto

What it measures, in order (see BENCHMARKS.md for what each figure means):

1. direct: the same engine runtime (same model, slot, compile settings) called
   in this process with no server, for the per-step baseline; freed before the
   server starts, so the two never share the CPU;
2. time from sending a request to its first Progress event, same adapter resident;
3. per-step cost as the client sees the Progress stream, against direct;
4. latency of a request that changes the adapter against one that keeps it
   (both adapters in the host cache, same prompt, seed and size);
5. throughput of `--clients` concurrent clients (one channel each) sending a
   Zipf-distributed mix over `--adapters` adapters, all preloaded;
6. the server's recompilation count over the whole run;
7. step previews: per-step time with a preview every step (preview_every=1) against
   none, alternating requests, same adapter resident; `--previews-only` measures
   just that (no direct baseline, change/keep or throughput runs), to keep the
   full-size random models bounded.

`--fuse` measures something else instead: one server per `--fuse-policies` policy
(never, always, auto; `shapes` unless --model says otherwise), all started before
any timing and only one of them busy at a time, each given two workloads round by
round, the policies' order rotated every round: "switching" (a different adapter
every request, `--switch-steps` steps) and "runs" (runs of `--run-length` requests
of one adapter, `--run-steps` steps). Per policy and workload: images per second
(median over rounds), p50/p99 latency, how many images came fused (`Image.fused`),
and what GetServerInfo says (policy, pristine bytes, recompilations); for auto, the
figures its cost model decides by (the server's `--fuse auto:` log line).

Random full-size models are exported to a temporary diffusers folder that the
server loads with `--model DIR` (the real denoiser; tiny text encoders and VAE).
The last line printed is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.processes import stop_process, wait_for_serving_line
from benchmarks.swap import ATTENTION_PROJECTIONS, log, machine_info, summarize

DEFAULT_MODEL = "tiny-flux"
DEFAULT_FUSE_MODEL = "shapes"  # --fuse: a trained model with shipped adapters, whose steps are cheap
FUSE_POLICIES = ("never", "always", "auto")
# --fuse: random adapters written beside the shipped ones, over every slot layer, so the switching workload
# meets every rank bucket (the shipped ones are rank 16 on a few layers).
FUSE_RANDOM_RANKS = (32, 64)
DEFAULT_THREADS = 1
ZIPF_EXPONENT = 1.1
PROMPT = "a lighthouse at dusk, oil painting"
SERVER_START_TIMEOUT_S = 1800.0


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def zipf_sequence(count: int, adapters: int, exponent: float, seed: int) -> list[int]:
    """Adapter indices drawn from a Zipf(exponent) law over `adapters` choices."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** exponent for rank in range(adapters)]
    return rng.choices(range(adapters), weights=weights, k=count)


def adapter_name(index: int) -> str:
    return f"a{index:03d}"


# --------------------------------------------------------------------------- set-up (torch, before any event loop)


def prepare_model(args, workdir: Path) -> tuple[str, object, float]:
    """The --model value the server gets, a pipeline to write adapters against, and the seconds spent.

    The full-size random models (those export-model does not write) are built here in --dtype,
    at --layers depth, and saved to a folder the server loads with --model DIR; the others are
    served by name.
    """
    import torch

    from loraswap.server.engine.models import BUILTINS, save_model_folder

    started = time.perf_counter()
    builtin = BUILTINS.get(args.model)
    if builtin is None:
        raise SystemExit(f"unknown --model {args.model!r}; use one of {', '.join(BUILTINS)}")
    if builtin.exportable:
        return args.model, builtin.build(torch.float32), time.perf_counter() - started
    pipe = builtin.build(getattr(torch, args.dtype), args.layers)
    folder = save_model_folder(pipe, workdir / args.model, builtin.defaults)
    return str(folder), pipe, time.perf_counter() - started


def write_adapters(pipe, adapter_dir: Path, count: int, rank: int) -> tuple[float, int]:
    """`count` random rank-`rank` adapters on the attention projections; returns seconds and bytes of one."""
    from benchmarks.swap import write_lora_file
    from loraswap.server.engine.families import family_of
    from loraswap.server.engine.pipeline.target_layers import resolve_target_layers

    started = time.perf_counter()
    traits = family_of(pipe)
    denoiser = traits.denoiser(pipe)
    patterns = ATTENTION_PROJECTIONS[traits.family.value]
    layers = resolve_target_layers(denoiser, patterns)
    size = 0
    for index in range(count):
        path = write_lora_file(
            pipe, layers, adapter_dir / adapter_name(index), rank=rank, patterns=patterns, seed=index
        )
        size = path.stat().st_size
    return time.perf_counter() - started, size


def measure_preview_cost(pipe, model: str, args, repeats: int = 50) -> dict:
    """What one step preview costs on its own, in this process, at --size and at 1024 px: project, copy, encode.

    The same code the server's step callback runs (engine/pipeline/previews.py), on latents of the pipeline's shape
    (Flux's packed), so the figure holds even when a busy machine blurs the A/B comparison of whole steps.
    """
    import torch

    from loraswap.server.engine.families import family_of
    from loraswap.server.engine.models import latent_rgb
    from loraswap.server.engine.pipeline.previews import LatentPreviewer
    from loraswap.server.engine.request_rules import RequestRules
    from loraswap.server.engine.types import GenerationRequest, ModelDefaults

    traits = family_of(pipe)
    channels, factor = pipe.vae.config.latent_channels, pipe.vae_scale_factor
    previewer = LatentPreviewer(
        latent_rgb(model, pipe), channels, torch.device("cpu"),
        lambda latents, height, width: traits.spatial_latents(pipe, latents, height, width),
    )  # fmt: skip
    rules = RequestRules(ModelDefaults(64, 64, 4, 1.0), size_multiple=16, min_size=16, max_size=4096)
    costs = {}
    for size in (args.size, 1024):
        side = size // factor
        latents = torch.randn(1, channels, side, side, dtype=getattr(torch, args.dtype))
        if traits.family.value == "flux":
            latents = pipe._pack_latents(latents, 1, channels, side, side)
        params = rules.resolve(GenerationRequest(prompt="p", width=size, height=size, preview_every=1))
        previewer.encode(latents, params)
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            previewer.encode(latents, params)
            timings.append(time.perf_counter() - started)
        costs[f"preview_ms_at_{size}px"] = statistics.median(timings) * 1000.0
    return costs


def engine_config(args, model: str, adapter_dir: Path):
    from loraswap.server.engine.config import EngineConfig

    return EngineConfig(
        model=model,
        device="cpu",
        dtype=args.dtype,
        max_rank=args.max_rank,
        compile=args.compile_backend != "none",
        compile_backend=args.compile_backend if args.compile_backend != "none" else "inductor",
        adapter_dir=adapter_dir,
        torch_threads=args.threads,
    )


def measure_direct(args, model: str, adapter_dir: Path) -> dict:
    """The engine runtime called in-process (no scheduler, no gRPC): per-step and per-request baselines."""
    import torch

    from loraswap.server.engine.adapters.formats import load_canonical
    from loraswap.server.engine.adapters.sources import AdapterFile
    from loraswap.server.engine.pipeline.startup import start_runtime
    from loraswap.server.engine.types import GenerationRequest

    started = time.perf_counter()
    runtime = start_runtime(engine_config(args, model, adapter_dir))
    ready_s = time.perf_counter() - started
    path = adapter_dir / adapter_name(0) / "pytorch_lora_weights.safetensors"
    adapter = load_canonical(AdapterFile(adapter_name(0), path, "local"), runtime.slot_spec())
    params = runtime.request_rules.resolve(
        GenerationRequest(
            prompt=PROMPT, adapter=adapter_name(0), seed=0, num_inference_steps=args.steps,
            width=args.size, height=args.size,
        )
    )  # fmt: skip
    steps, totals = [], []
    stamps: list[float] = []
    for index in range(1 + args.repeats):
        stamps.clear()
        begun = time.perf_counter()
        runtime.generate(
            params, ((adapter, 1.0),), on_step=lambda _: stamps.append(time.perf_counter()), is_cancelled=bool
        )
        if index > 0:  # the first run is a warm-up
            totals.append(time.perf_counter() - begun)
            steps.extend(later - earlier for earlier, later in itertools.pairwise(stamps))
    recompilations = runtime.recompilations
    del runtime, adapter
    gc.collect()
    torch.set_num_threads(args.threads)
    return {
        "ready_s": ready_s,
        "step": summarize(steps),
        "request": summarize(totals),
        "recompilations": recompilations,
    }


# --------------------------------------------------------------------------- the server process


class ServerProcess:
    """`loraswap serve` on a port the OS picks, in its own process; stopped with SIGTERM."""

    def __init__(self, args, model: str, adapter_dir: Path, log_path: Path, extra_flags: tuple[str, ...] = ()) -> None:
        command = [
            sys.executable, "-m", "loraswap.client.command", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
            "--adapter-dir", str(adapter_dir), "--torch-threads", str(args.threads), "--device", "cpu",
            "--dtype", args.dtype, "--max-rank", str(args.max_rank), "--log-level", "WARNING",
        ]  # fmt: skip
        if args.compile_backend == "none":
            command.append("--no-compile")
        else:
            command += ["--compile", "--compile-backend", args.compile_backend]
        command += extra_flags
        self.log_path = log_path
        self._log = log_path.open("w")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.port: int | None = None

    def wait_until_serving(self, timeout: float) -> float:
        """Block until the server says it serves; returns seconds waited."""
        started = time.perf_counter()
        serving = wait_for_serving_line(self.process, timeout)
        if serving is None:
            self.stop()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"the server did not start within {timeout:.0f} s; its log ends:\n{tail}")
        self.port, at = serving
        return at - started

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()


# --------------------------------------------------------------------------- the client side (no torch)


async def timed_request(client, adapter: str, args, preview_every: int = 0, steps: int | None = None) -> dict:
    """One Generate call (`steps`: None, --steps): when it was sent, when each Progress arrived, when the image
    arrived."""
    from loraswap.client import GeneratedImage, Progress

    steps = args.steps if steps is None else steps
    sent = time.perf_counter()
    progress_at: list[float] = []
    progress_ms: list[float] = []
    preview_bytes: list[int] = []
    image = None
    async for event in client.generate(
        PROMPT, adapter=adapter, seed=0, num_inference_steps=steps, width=args.size, height=args.size,
        preview_every=preview_every,
    ):  # fmt: skip
        if isinstance(event, Progress):
            progress_at.append(time.perf_counter())
            progress_ms.append(event.elapsed_ms)
            if event.preview:
                preview_bytes.append(len(event.preview))
        elif isinstance(event, GeneratedImage):
            image = event
    done = time.perf_counter()
    if image is None or len(progress_at) != steps:
        raise RuntimeError(f"request for {adapter!r} ended with {len(progress_at)} progress events and no image")
    return {
        "latency_s": done - sent,
        "first_progress_s": progress_at[0] - sent,
        "client_steps_s": [b - a for a, b in itertools.pairwise(progress_at)],
        "server_steps_s": [(b - a) / 1000.0 for a, b in itertools.pairwise(progress_ms)],
        "swap_ms": image.timings.adapter_swap_ms,
        "fused": image.fused,
        "preview_bytes": preview_bytes,
    }


async def measure_previews(client, args) -> dict:
    """Per-step time with a preview every step against none: alternating requests, same adapter resident.

    A step's time is the difference of consecutive Progress.elapsed_ms (the server's clock): step k's
    preview is made between them, so every difference holds one preview and one denoising step.
    """
    adapter = adapter_name(0)
    await timed_request(client, adapter, args, preview_every=1)  # warm: the first preview's one-time costs
    plain, previewed, client_plain, client_previewed, sizes = [], [], [], [], []
    for _ in range(args.repeats):
        without = await timed_request(client, adapter, args)
        with_previews = await timed_request(client, adapter, args, preview_every=1)
        if len(with_previews["preview_bytes"]) != args.steps:
            raise RuntimeError(f"asked for a preview every step, got {len(with_previews['preview_bytes'])}")
        plain += without["server_steps_s"]
        previewed += with_previews["server_steps_s"]
        client_plain += without["client_steps_s"]
        client_previewed += with_previews["client_steps_s"]
        sizes += with_previews["preview_bytes"]
    plain_step, previewed_step = summarize(plain), summarize(previewed)
    overhead = ratio(previewed_step["median_s"], plain_step["median_s"])
    log(f"previews: step {plain_step['median_s']:.4f} s without, {previewed_step['median_s']:.4f} s with "
        f"(x{overhead:.3f})")  # fmt: skip
    return {
        "step_without": plain_step,
        "step_with_every_step": previewed_step,
        "with_over_without": overhead,
        "client_with_over_without": ratio(statistics.median(client_previewed), statistics.median(client_plain)),
        "preview_bytes_median": statistics.median(sizes),
    }


async def measure_server(args, port: int) -> dict:
    from loraswap.client import AsyncLoraswapClient

    target = f"127.0.0.1:{port}"
    async with AsyncLoraswapClient(target, default_timeout=3600) as client:
        info = await client.server_info()
        recompilations_before = info.recompilations
        log(f"server: {info.model} ({info.family}), compiled={info.compiled}, max rank {info.max_rank}")
        preload_started = time.perf_counter()
        for index in range(args.adapters):
            await client.preload_adapter(adapter_name(index))
        preload_s = time.perf_counter() - preload_started

        # Same adapter resident: time to first progress, and the streamed per-step cost.
        same = adapter_name(0)
        await timed_request(client, same, args)  # makes it resident
        firsts, client_steps, server_steps = [], [], []
        for _ in range(args.repeats):
            record = await timed_request(client, same, args)
            firsts.append(record["first_progress_s"])
            client_steps += record["client_steps_s"]
            server_steps += record["server_steps_s"]
        log(f"first progress {statistics.median(firsts):.3f} s; streamed step {statistics.median(client_steps):.3f} s")
        previews = await measure_previews(client, args)
        if args.previews_only:
            info = await client.server_info()
            return {"preload_s": preload_s, "first_progress": summarize(firsts), "client_steps": client_steps,
                    "server_steps": server_steps, "previews": previews, "throughput": None,
                    "recompilations_before": recompilations_before, "recompilations": info.recompilations}  # fmt: skip

        # Change versus keep, alternating B B A A B B ...: every first of a pair swaps, every second keeps.
        change, keep, change_swap_ms = [], [], []
        names = (adapter_name(1), adapter_name(0))
        for index in range(args.repeats):
            name = names[index % 2]
            changed = await timed_request(client, name, args)
            kept = await timed_request(client, name, args)
            change.append(changed["latency_s"])
            change_swap_ms.append(changed["swap_ms"])
            keep.append(kept["latency_s"])
        log(f"change {statistics.median(change):.3f} s, keep {statistics.median(keep):.3f} s")

        throughput = await measure_throughput(args, target)
        info = await client.server_info()
    return {
        "preload_s": preload_s,
        "first_progress": summarize(firsts),
        "client_steps": client_steps,
        "server_steps": server_steps,
        "change": change,
        "keep": keep,
        "change_swap_ms": change_swap_ms,
        "throughput": throughput,
        "previews": previews,
        "recompilations_before": recompilations_before,
        "recompilations": info.recompilations,
    }


async def measure_throughput(args, target: str) -> dict:
    """`--clients` closed-loop clients, one channel each, sharing a Zipf mix of requests."""
    from loraswap.client import AsyncLoraswapClient

    sequence = zipf_sequence(args.mix_requests, args.adapters, ZIPF_EXPONENT, seed=0)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in sequence:
        queue.put_nowait(index)
    latencies: list[float] = []
    swaps = 0

    async def client_loop() -> None:
        nonlocal swaps
        async with AsyncLoraswapClient(target, default_timeout=3600) as client:
            while True:
                try:
                    index = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                record = await timed_request(client, adapter_name(index), args)
                latencies.append(record["latency_s"])
                swaps += record["swap_ms"] > 0

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(args.clients)))
    wall = time.perf_counter() - started
    log(f"throughput: {len(sequence)} requests in {wall:.1f} s")
    return {
        "clients": args.clients,
        "adapters": args.adapters,
        "zipf_exponent": ZIPF_EXPONENT,
        "requests": len(sequence),
        "distinct_adapters": len(set(sequence)),
        "swaps": swaps,
        "wall_s": wall,
        "images_per_s": len(sequence) / wall,
        "latency_s": {
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
            "max": max(latencies),
        },
    }


def ran_with(args, benchmark: str) -> dict:
    """The head of a report: which benchmark, on what model and settings."""
    return {
        "benchmark": benchmark,
        "model": args.model,
        "layers": args.layers,
        "dtype": args.dtype,
        "device": "cpu",
        "torch_threads": args.threads,
        "compile_backend": args.compile_backend,
        "size": args.size,
    }


# --------------------------------------------------------------------------- --fuse: never / always / auto


def write_fuse_adapters(pipe, model: str, adapter_dir: Path) -> list[str]:
    """The adapters of the --fuse workloads: the model's shipped ones (copied) and FUSE_RANDOM_RANKS random ones
    on its family's default slot layers, small enough to leave images sane; returns their names."""
    from loraswap.server.devtools.random_adapter import write_random_adapter
    from loraswap.server.engine.families import family_of
    from loraswap.server.engine.models import BUILTINS

    names = []
    shipped = BUILTINS[model].adapter_dir if model in BUILTINS else None
    if shipped is not None:
        for folder in sorted(path for path in shipped.iterdir() if path.is_dir()):
            shutil.copytree(folder, adapter_dir / folder.name)
            names.append(folder.name)
    targets = family_of(pipe).default_target_modules
    for rank in FUSE_RANDOM_RANKS:
        name = f"random-r{rank}"
        write_random_adapter(pipe, adapter_dir / name, rank=rank, target_modules=targets, seed=rank, init_std=0.01)
        names.append(name)
    return names


def fuse_workloads(args, adapters: list[str]) -> dict[str, list[tuple[str, int]]]:
    """(adapter, steps) per request of each workload: "switching" changes adapter every request, "runs" keeps one
    adapter for --run-length requests at a time."""
    switching = [(adapters[index % len(adapters)], args.switch_steps) for index in range(args.fuse_requests)]
    runs = [
        (adapters[(index // args.run_length) % len(adapters)], args.run_steps) for index in range(args.fuse_requests)
    ]
    return {"switching": switching, "runs": runs}


async def run_workload(target: str, requests: list[tuple[str, int]], args) -> dict:
    """`--fuse-clients` closed-loop clients, one channel each, draining `requests` in order."""
    from loraswap.client import AsyncLoraswapClient

    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    records: list[dict] = []

    async def client_loop() -> None:
        async with AsyncLoraswapClient(target, default_timeout=3600) as client:
            while True:
                try:
                    adapter, steps = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records.append(await timed_request(client, adapter, args, steps=steps))

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(args.fuse_clients)))
    return {"wall_s": time.perf_counter() - started, "records": records}


async def measure_fuse_policies(args, ports: dict[str, int], adapters: list[str]) -> dict:
    """Each workload on each policy's server, round by round with the policies' order rotated; a first untimed
    pass of each workload warms every server (each adapter preloaded and merged or copied once)."""
    from loraswap.client import AsyncLoraswapClient

    workloads = fuse_workloads(args, adapters)
    policies = list(ports)
    targets = {policy: f"127.0.0.1:{port}" for policy, port in ports.items()}
    for policy, target in targets.items():
        async with AsyncLoraswapClient(target, default_timeout=3600) as client:
            for name in adapters:
                await client.preload_adapter(name)
        for requests in workloads.values():
            await run_workload(target, requests, args)
    rounds: dict[str, dict[str, list[dict]]] = {w: {p: [] for p in policies} for w in workloads}
    for round_index in range(args.fuse_rounds):
        shift = round_index % len(policies)
        for workload, requests in workloads.items():
            for policy in policies[shift:] + policies[:shift]:
                rounds[workload][policy].append(await run_workload(targets[policy], requests, args))
        log(f"--fuse: round {round_index + 1}/{args.fuse_rounds}")
    infos = {}
    for policy, target in targets.items():
        async with AsyncLoraswapClient(target, default_timeout=3600) as client:
            info = await client.server_info()
        infos[policy] = {
            "fuse": info.fuse, "fuse_pristine_bytes": info.fuse_pristine_bytes,
            "recompilations": info.recompilations, "rank_buckets": list(info.rank_buckets),
        }  # fmt: skip
    return {"rounds": rounds, "server_info": infos, "workloads": workloads}


def summarize_fuse(measured: dict, args) -> dict:
    """Per workload and policy: images/s (median over rounds), latency percentiles over every timed request, the
    images that came fused, swaps; and the goals' ratios: auto against the better fixed policy and against never."""
    summary = {}
    for workload, by_policy in measured["rounds"].items():
        figures = {}
        for policy, rounds in by_policy.items():
            records = [record for one in rounds for record in one["records"]]
            latencies = [record["latency_s"] for record in records]
            swapped = [record for record in records if record["swap_ms"] > 0]
            fused_swaps = [record["swap_ms"] for record in swapped if record["fused"]]
            unfused_swaps = [record["swap_ms"] for record in swapped if not record["fused"]]
            figures[policy] = {
                "images_per_s": statistics.median(len(one["records"]) / one["wall_s"] for one in rounds),
                "images_per_s_by_round": [len(one["records"]) / one["wall_s"] for one in rounds],
                "latency_s": {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)},
                "images": len(records),
                "fused_images": sum(record["fused"] for record in records),
                "swaps": len(swapped),
                "fused_swaps": len(fused_swaps),
                "unfused_swaps": len(unfused_swaps),
                "swap_ms_median": {
                    "fused": statistics.median(fused_swaps) if fused_swaps else None,
                    "unfused": statistics.median(unfused_swaps) if unfused_swaps else None,
                },
            }
        rate = {policy: values["images_per_s"] for policy, values in figures.items()}
        fixed = {policy: rate[policy] for policy in ("never", "always") if policy in rate}
        goals = {}
        if "auto" in rate and fixed:
            best = max(fixed, key=fixed.get)
            goals = {
                "better_fixed_policy": best,
                "auto_over_better_fixed": rate["auto"] / fixed[best],
                "auto_over_never": rate["auto"] / rate["never"] if "never" in rate else None,
                "always_over_never": rate["always"] / rate["never"] if len(fixed) == 2 else None,
            }
        steps = measured["workloads"][workload][0][1]
        summary[workload] = {
            "steps": steps,
            "requests_per_round": len(measured["workloads"][workload]),
            "adapter_changes": "every request" if workload == "switching" else f"every {args.run_length} requests",
            "policies": figures,
            "goals": goals,
        }
    return summary


def auto_rule_figures(log_path: Path) -> str | None:
    """The `--fuse auto:` line the server logs at start-up (its cost model's constants and predictions), if any."""
    for line in log_path.read_text().splitlines():
        if "--fuse auto:" in line:
            return line[line.index("--fuse auto:") :].strip()
    return None


def run_fuse_comparison(args) -> dict:
    """--fuse: the two workloads on a server per policy, interleaved; one result dict."""
    import torch

    run_started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loraswap-serve-fuse-") as temp:
        workdir = Path(temp)
        adapter_dir = workdir / "adapters"
        adapter_dir.mkdir()
        log(f"preparing {args.model}")
        model, pipe, _ = prepare_model(args, workdir)
        adapters = write_fuse_adapters(pipe, args.model, adapter_dir)
        del pipe
        gc.collect()
        log(f"adapters: {', '.join(adapters)}; starting a server per policy: {', '.join(args.fuse_policy_list)}")
        spawned = time.perf_counter()
        servers = {
            policy: ServerProcess(
                args, model, adapter_dir, workdir / f"server-{policy}.log",
                ("--fuse", policy, "--log-level", "INFO"),
            )
            for policy in args.fuse_policy_list
        }  # fmt: skip
        try:
            for server in servers.values():
                server.wait_until_serving(SERVER_START_TIMEOUT_S)
            startup_s = time.perf_counter() - spawned  # started together: until the last one serves
            log(f"{len(servers)} servers serving after {startup_s:.1f} s")
            measured = asyncio.run(
                measure_fuse_policies(args, {policy: server.port for policy, server in servers.items()}, adapters)
            )
        finally:
            for server in servers.values():
                server.stop()
        auto_figures = auto_rule_figures(servers["auto"].log_path) if "auto" in servers else None
    return {
        **ran_with(args, "serve_fuse"),
        "max_rank": args.max_rank,
        "clients": args.fuse_clients,
        "rounds": args.fuse_rounds,
        "adapters": adapters,
        "workloads": summarize_fuse(measured, args),
        "server_info": measured["server_info"],
        "auto_rule": auto_figures,
        "recompilations": sum(info["recompilations"] for info in measured["server_info"].values()),
        "servers_ready_s": startup_s,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "machine": machine_info(),
        "elapsed_s": time.perf_counter() - run_started,
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None,
        help=f"tiny-flux, tiny-sdxl, random-sdxl, random-flux or shapes (default: {DEFAULT_MODEL}; "
        f"{DEFAULT_FUSE_MODEL} with --fuse)",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="random-flux only: double-stream blocks to keep")
    parser.add_argument("--size", type=int, default=64, help="image width and height")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    parser.add_argument("--rank", type=int, default=8, help="rank of the benchmark's adapters")
    parser.add_argument("--max-rank", type=int, default=64, help="the server's --max-rank")
    parser.add_argument("--adapters", type=int, default=50, help="adapters in the Zipf mix")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients in the throughput run")
    parser.add_argument("--mix-requests", type=int, default=64, help="requests in the throughput run")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per latency figure (after 1 warm-up)")
    parser.add_argument("--dtype", default=None, help="weights' dtype (default: float32 tiny, bfloat16 random)")
    parser.add_argument("--compile-backend", default="aot_eager", help="the server's torch.compile backend; 'none'")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch CPU threads (server and direct)")
    parser.add_argument("--skip-direct", action="store_true", help="skip the in-process baseline")
    parser.add_argument(
        "--previews-only", action="store_true",
        help="measure only the step previews' cost (no direct baseline, change/keep or throughput runs)",
    )  # fmt: skip
    fuse = parser.add_argument_group("--fuse: never, always and auto side by side")
    fuse.add_argument(
        "--fuse", action="store_true",
        help="compare the server's --fuse policies on two workloads instead of the measurements above",
    )  # fmt: skip
    fuse.add_argument("--fuse-policies", default=",".join(FUSE_POLICIES), help="comma-separated --fuse policies")
    fuse.add_argument("--switch-steps", type=int, default=2, help='steps per request of the "switching" workload')
    fuse.add_argument("--run-steps", type=int, default=20, help='steps per request of the "runs" workload')
    fuse.add_argument("--run-length", type=int, default=4, help='requests per adapter in the "runs" workload')
    fuse.add_argument("--fuse-requests", type=int, default=12, help="requests per workload, policy and round")
    fuse.add_argument("--fuse-rounds", type=int, default=5, help="timed rounds (after one untimed pass)")
    fuse.add_argument("--fuse-clients", type=int, default=2, help="concurrent closed-loop clients per workload")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = DEFAULT_FUSE_MODEL if args.fuse else DEFAULT_MODEL
    args.fuse_policy_list = [policy.strip() for policy in args.fuse_policies.split(",") if policy.strip()]
    if args.fuse:
        unknown = [policy for policy in args.fuse_policy_list if policy not in FUSE_POLICIES]
        if unknown or not args.fuse_policy_list:
            parser.error(f"--fuse-policies takes some of {', '.join(FUSE_POLICIES)}; got {args.fuse_policies!r}")
        if min(args.switch_steps, args.run_steps, args.run_length, args.fuse_requests, args.fuse_rounds,
               args.fuse_clients) < 1:  # fmt: skip
            parser.error("--switch-steps, --run-steps, --run-length and the --fuse-* counts must be at least 1")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.model.startswith("random-") else "float32"
    if args.adapters < 2 or args.repeats < 1 or args.clients < 1 or args.steps < 2:
        parser.error("need --adapters >= 2, --repeats >= 1, --clients >= 1 and --steps >= 2")
    return args


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the JSON result as the last line of stdout, and return it."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    if args.fuse:
        result = run_fuse_comparison(args)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result), flush=True)
        return result
    run_started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loraswap-serve-bench-") as temp:
        workdir = Path(temp)
        adapter_dir = workdir / "adapters"
        log(f"preparing {args.model}")
        model, pipe, model_s = prepare_model(args, workdir)
        write_s, adapter_file_bytes = write_adapters(pipe, adapter_dir, args.adapters, args.rank)
        preview_cost = measure_preview_cost(pipe, args.model, args)
        log(f"one preview on its own: {preview_cost}")
        del pipe
        gc.collect()
        direct = None
        if not (args.skip_direct or args.previews_only):
            log("direct: the engine runtime in this process")
            direct = measure_direct(args, model, adapter_dir)
            log(f"direct: step {direct['step']['median_s']:.3f} s, request {direct['request']['median_s']:.3f} s")
        log("starting the server")
        server = ServerProcess(args, model, adapter_dir, workdir / "server.log")
        try:
            startup_s = server.wait_until_serving(SERVER_START_TIMEOUT_S)
            log(f"server on port {server.port} after {startup_s:.1f} s")
            measured = asyncio.run(measure_server(args, server.port))
        finally:
            server.stop()

    streamed_step = summarize(measured["client_steps"])
    server_step = summarize(measured["server_steps"])
    adapter_change = None
    if not args.previews_only:
        change, keep = summarize(measured["change"]), summarize(measured["keep"])
        adapter_change = {
            "change": change,
            "keep": keep,
            "change_over_keep": ratio(change["median_s"], keep["median_s"]),
            "server_swap": summarize([ms / 1000.0 for ms in measured["change_swap_ms"]]),
        }
    result = {
        **ran_with(args, "serve"),
        "steps": args.steps,
        "adapter_rank": args.rank,
        "adapter_file_bytes": adapter_file_bytes,
        "max_rank": args.max_rank,
        "repeats": args.repeats,
        "time_to_first_progress": measured["first_progress"],
        "per_step": {
            "direct": direct["step"] if direct else None,
            "streamed_client": streamed_step,
            "streamed_server": server_step,
            "streamed_over_direct": ratio(streamed_step["median_s"], direct["step"]["median_s"]) if direct else None,
        },
        "direct_request": direct["request"] if direct else None,
        "adapter_change": adapter_change,
        "throughput": measured["throughput"],
        "previews": {
            **measured["previews"],
            **preview_cost,
            # The preview's own cost against the streamed step it is added to (robust to a busy machine).
            "preview_over_step": preview_cost[f"preview_ms_at_{args.size}px"] / 1000.0 / streamed_step["median_s"],
        },
        "recompilations": measured["recompilations"] + (direct["recompilations"] if direct else 0),
        "recompilations_server": measured["recompilations"],
        "recompilations_direct": direct["recompilations"] if direct else None,
        "setup_s": {
            "prepare_model": model_s,
            "write_adapters": write_s,
            "direct_ready": direct["ready_s"] if direct else None,
            "server_ready": startup_s,
            "preload_adapters": measured["preload_s"],
        },
        "machine": machine_info(),
        "elapsed_s": time.perf_counter() - run_started,
    }
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(line, flush=True)
    return result


if __name__ == "__main__":
    main()
