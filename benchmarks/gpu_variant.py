"""One variant of the GPU check (gpu_check.py), measured in a child process of its own.

The child starts the variant's serving path (gpu_serving.py: the engine's start-up phases, then for the slot
variants `adapters`), and runs `first_request` (untimed: it compiles), `timed_requests`, `swap_floor`, `host_syncs`
(on a CPU) and `profile`. Each phase is logged when it begins and ends, the engine's start-up lines among them
(PhaseMarks writes them for the parent), and the result so far is printed as one JSON line after each (Emitter), so
that a parent that stops the child keeps what it measured and knows where it was.

Figures:
- `seconds_per_image`: the median wall clock of the timed requests, each the whole served request (swap, prompt
  encoding, denoising, VAE decode, image encoding);
- `phases_ms`: the median of each phase, from the runtime's Timings: `swap`, `encode_prompt`, `denoise` (the steps
  alone: the runtime's denoise_ms less encode_prompt_ms), `decode` (the VAE alone: decode_ms less
  encode_image_ms), `encode_image`;
- `swap_ms` (the median swap) and `swap_floor_ms`: the bytes the swap reads and writes moved by plain copies, timed
  in the same process (CUDA events on a GPU): a merge's floor copies each touched layer's pristine copy into a
  scratch of the weight's stored dtype; the slot's copies the adapter's factors to the device
  (`factors_to_device_ms`, also given for the fused variants);
- `recompilations`: graphs compiled during the timed requests (swaps included);
- `host_syncs_per_step`: the host's waits for the device from the end of one scheduler step to the end of the
  next (each a step's worth: the step callback, then the next step's denoiser call): on CUDA the warnings of
  `torch.cuda.set_sync_debug_mode("warn")` in the timed requests (and `host_syncs_per_swap`, inside the residency's
  load_stack); on a CPU loraswap.server.devtools.host_syncs.HostSyncCounter over one more, untimed, request;
- `profile`: one more request under torch.profiler, at `--profile-steps` steps (the same graphs, a profile a few
  times smaller to record and read), summarised by gpu_profile.py (no trace file): kernel time by kind (the swap,
  those steps and the decode), idle time per step (steps told apart by the same scheduler-step marks), the
  attention kernels;
- `startup_s`, `first_request_s`, the peak GPU memory, and what the runtime says of itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
import warnings

from benchmarks.gpu_serving import VARIANTS, BarePath, Served, SlotPath, median_phases, two_adapters
from loraswap.server.engine.pipeline.call_hooks import around_calls

log = logging.getLogger("benchmarks.gpu_variant")

# A line the child writes to stderr for every phase it enters or leaves; the parent reads them back.
PHASE_MARK = "gpu_check-phase "
# The engine's start-up phases (startup.py), and the check's own after them, in the order a child runs them.
STARTUP_PHASES = ("load", "slot", "quantize", "compile", "warm-up")
CHECK_PHASES = ("adapters", "first_request", "timed_requests", "swap_floor", "host_syncs", "profile")
# The profiled request is skipped when less than this many seconds (plus two requests' worth) are left.
PROFILE_RESERVE_S = 20.0


class PhaseMarks(logging.Handler):
    """Writes a PHASE_MARK line to stderr for every log record that names a phase (the engine's start-up lines
    carry extra={"phase": ...}; so do the check's own), for the parent to read where its child is."""

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "phase", None)
        if phase is None:
            return
        event = getattr(record, "event", None)
        if event is None:
            event = "begins" if "begin" in record.getMessage().lower() else "done"
        mark = {"phase": phase, "event": event, "seconds": getattr(record, "seconds", None)}
        sys.stderr.write(PHASE_MARK + json.dumps(mark) + "\n")
        sys.stderr.flush()


def _configure_logging() -> None:
    """The engine's and the check's log lines on stderr (the start-up phases among them), foreign ones at WARNING."""
    text = logging.StreamHandler(sys.stderr)
    text.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(text)
    root.addHandler(PhaseMarks())
    root.setLevel(logging.WARNING)
    for name in ("loraswap", "benchmarks"):
        logging.getLogger(name).setLevel(logging.INFO)


@contextlib.contextmanager
def _phase(name: str):
    """Log a phase's beginning and its end (with its seconds), as the engine's start-up logs its own."""
    log.info("gpu_check %s begins", name, extra={"phase": name, "event": "begins"})
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    log.info(
        "gpu_check %s: %.2f s", name, seconds, extra={"phase": name, "event": "done", "seconds": round(seconds, 3)}
    )


class Emitter:
    """The child's result so far, printed as one JSON line on stdout after every stage (the parent keeps the last)."""

    def __init__(self, variant: str) -> None:
        self.result: dict = {"variant": variant, "complete": False}

    def update(self, **values) -> None:
        self.result.update(values)
        print(json.dumps(self.result), flush=True)


def after_each_step(pipe, callback):
    """`callback()` after each call of the pipeline's `scheduler.step`: once a step, after the denoiser and before
    the step callback, whatever the runner does in its callback."""
    return around_calls(pipe.scheduler, "step", after=callback)


class CudaSyncs:
    """The host's waits for the device, from the warnings of torch.cuda.set_sync_debug_mode("warn"): between each
    request's step ends, and inside its swap."""

    how = "torch.cuda.set_sync_debug_mode"

    def __init__(self) -> None:
        self.step_syncs = 0
        self.steps = 0
        self.swap_syncs = 0
        self.swaps = 0
        self._step_ends: list[int] = []  # how many warnings had come at each step end of the request under way
        self._swap_began = 0

    def __enter__(self) -> CudaSyncs:
        import torch

        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc_info) -> None:
        import torch

        torch.cuda.set_sync_debug_mode(0)
        self._caught.__exit__(*exc_info)

    def _syncs(self, begin: int, end: int) -> int:
        return sum("synchroniz" in str(record.message) for record in self._records[begin:end])

    def step_ended(self) -> None:
        self._step_ends.append(len(self._records))

    def swap_begins(self) -> None:
        self._swap_began = len(self._records)

    def swap_ended(self) -> None:
        self.swap_syncs += self._syncs(self._swap_began, len(self._records))
        self.swaps += 1

    def request_done(self) -> None:
        """Count the syncs from the request's first step end to its last."""
        if len(self._step_ends) > 1:
            self.step_syncs += self._syncs(self._step_ends[0], self._step_ends[-1])
            self.steps += len(self._step_ends) - 1
        self._step_ends = []

    def figures(self) -> dict:
        return {
            "host_syncs_per_step": round(self.step_syncs / self.steps, 3) if self.steps else None,
            "host_syncs_per_swap": round(self.swap_syncs / self.swaps, 3) if self.swaps else None,
            "host_syncs_counted_by": self.how,
        }


def _cpu_host_syncs(path, index: int, device: str) -> dict:
    """One more (untimed) request under HostSyncCounter, the waits counted between the scheduler's steps."""
    import torch

    try:
        from loraswap.server.devtools.host_syncs import HostSyncCounter
    except ImportError as error:
        return {"host_syncs_per_step": None, "host_syncs_counted_by": f"no host sync counter: {error}"}
    pipe = path.pipe
    counter = HostSyncCounter(torch.device(device), watched=pipe.components.values())
    with counter, counter.steps_of(pipe.scheduler):
        path.request(index)
    # [before the first step's end, after step 1, ..., after the last]: the ones between are a step each.
    between = counter.per_step[1:-1]
    last = len(counter.per_step) - 1
    return {
        "host_syncs_per_step": round(sum(between) / len(between), 3) if between else None,
        "host_syncs_counted_by": HostSyncCounter.__name__,
        "host_syncs_ops": sorted({sync.op for sync in counter.seen if 0 < sync.step < last}),
    }


def _profiled_request(path, index: int, args: argparse.Namespace) -> dict:
    """One request under torch.profiler, summarised by gpu_profile (kernel time by kind, idle per step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.gpu_profile import STEP_END, SWAP_BEGINS, SWAP_DONE, records_from_profile, summarise

    def mark(name: str) -> None:
        with record_function(name):
            pass

    cuda = torch.device(args.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    started = time.perf_counter()
    # The swap's own launches, marked around the residency's load_stack (the runtime reports the swap after the run).
    swaps = (
        around_calls(path.residency, "load_stack", before=lambda: mark(SWAP_BEGINS), after=lambda: mark(SWAP_DONE))
        if path.residency is not None
        else contextlib.nullcontext()
    )
    with (
        profile(activities=activities, record_shapes=True) as prof,
        after_each_step(path.pipe, lambda: mark(STEP_END)),
        swaps,
    ):
        path.request(index, steps=args.profile_steps)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    records, marks = records_from_profile(prof, device_type="cuda" if cuda else "cpu")
    swap = (marks[SWAP_BEGINS][0], marks[SWAP_DONE][0]) if marks[SWAP_BEGINS] and marks[SWAP_DONE] else None
    # The rank for every variant, bare too: FLUX's 64-channel projections then count alike in each.
    summary = summarise(records, rank=args.rank, swap=swap, step_ends=marks[STEP_END])
    return {"steps": args.profile_steps, "request_s": round(seconds, 3), "kernels": len(records), **summary}


def _device_facts(device: str) -> dict:
    import torch

    if torch.device(device).type != "cuda":
        return {"gpu": None}
    return {
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 1024**3, 2),
    }


def _start(args: argparse.Namespace):
    """The variant's serving path, built whole: start-up, then (slot variants) the adapters."""
    variant = VARIANTS[args.variant]
    if not variant.slot:
        return BarePath.start(args, variant)
    runtime = SlotPath.start(args, variant)
    with _phase("adapters"):
        adapters = two_adapters(runtime, args.rank, args.device)
    return SlotPath(args, variant, runtime, adapters)


def timed_requests(path, args: argparse.Namespace, cuda: bool) -> tuple[list[Served], CudaSyncs | None]:
    """The timed requests; on CUDA with their host syncs counted between step ends and inside swaps."""
    import torch

    served = []
    counting = CudaSyncs() if cuda else None
    steps = after_each_step(path.pipe, counting.step_ended) if counting else contextlib.nullcontext()
    swaps = (
        around_calls(path.residency, "load_stack", before=counting.swap_begins, after=counting.swap_ended)
        if counting and path.residency is not None
        else contextlib.nullcontext()
    )
    with counting or contextlib.nullcontext(), steps, swaps:
        for index in range(1, args.requests + 1):
            if cuda:
                torch.cuda.synchronize()  # the request before left nothing queued: each is timed alone
            served.append(path.request(index))
            if counting:
                counting.request_done()
    return served, counting


def run_variant(args: argparse.Namespace, emit: Emitter) -> None:
    """Measure one variant, printing what is known after every stage (see Emitter)."""
    import torch

    variant = VARIANTS[args.variant]
    child_started = time.monotonic()
    deadline = child_started + (args.seconds or float("inf"))
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    path = _start(args)
    emit.update(startup_s=round(time.monotonic() - child_started, 1), **path.facts(), **_device_facts(args.device))

    with _phase("first_request"):
        first = path.request(0)
    graphs_before = path.recompilations
    emit.update(first_request_s=round(first.seconds, 2), graphs_since_ready=graphs_before)

    with _phase("timed_requests"):
        served, counted = timed_requests(path, args, cuda)
    phases = median_phases(served)
    emit.update(
        seconds_per_image=round(statistics.median(request.seconds for request in served), 3),
        seconds_per_image_all=[round(request.seconds, 3) for request in served],
        phases_ms=phases,
        swap_ms=phases["swap"] if variant.slot else None,
        swaps=sum(request.timings.adapter_swap_ms > 0 for request in served),
        recompilations=path.recompilations - graphs_before,
        graphs_since_ready=path.recompilations,
        **_device_facts(args.device),
    )

    with _phase("swap_floor"):
        try:
            emit.update(**path.floor(args.device))
        except Exception as error:  # the figures above stand without it
            log.exception("the swap floor failed")
            emit.update(swap_floor_ms=None, swap_floor_failed=f"{type(error).__name__}: {_first_line(error)}")

    index = args.requests + 1
    if counted is not None:
        emit.update(**counted.figures())
    else:
        with _phase("host_syncs"):
            emit.update(**_cpu_host_syncs(path, index, args.device))
        index += 1

    left = deadline - time.monotonic()
    if left < PROFILE_RESERVE_S + 2 * statistics.median(request.seconds for request in served):
        emit.update(profile={"skipped": f"{left:.0f} s left of the variant's limit"})
    else:
        with _phase("profile"):
            try:
                profile_summary = _profiled_request(path, index, args)
            except Exception as error:  # the figures above stand without it
                log.exception("the profiled request failed")
                profile_summary = {"failed": f"{type(error).__name__}: {_first_line(error)}"}
        emit.update(profile=profile_summary)
    emit.update(complete=True, child_s=round(time.monotonic() - child_started, 1))


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0][:500]


def child_main(args: argparse.Namespace) -> int:
    """A child process's whole life: one variant, its result lines on stdout, its log and phase marks on stderr."""
    _configure_logging()
    emit = Emitter(args.variant)
    try:
        run_variant(args, emit)
    except Exception as error:
        log.exception("variant %s failed", args.variant)
        emit.update(error=f"{type(error).__name__}: {_first_line(error)}")
        return 1
    return 0
