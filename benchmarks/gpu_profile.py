"""Where one profiled request's device time goes: kernel time by kind, idle time per step, the attention kernels.

The GPU check (gpu_check.py) profiles one request per variant with torch.profiler and keeps no trace file: it
turns the profile into plain records (`records_from_profile`) and summarises them here (`summarise`, a pure
function, tested on the CPU with synthetic records).

A record is one kernel: its name, its start and end on the device's timeline (microseconds), the input shapes of
the aten op that launched it (record_shapes), that op's name, and when the host launched it (on the host's
timeline, which the profiler keeps in the same clock). Plain (name, start, end, shapes) tuples are records too.
On a CPU there are no kernels: the outermost aten ops stand in for them (the smoke run exercises the same code).

Kinds, decided in this order:
- `merge`: launched inside the swap (between the check's `gpu_check.swap_begins` and `gpu_check.swap_done` marks);
- `other`: memory copies and fills (memcpy, memset);
- `elementwise`: inductor's generated pointwise and reduction kernels (triton_poi/per/red), aten's elementwise,
  reduction, copy, norm and activation kernels, and any other aten op's kernel that is neither attention nor GEMM;
- `attention`: flash, fmha, cuDNN SDPA and any kernel of an attention op;
- `lora_factors`: a GEMM whose op has an input dimension equal to the adapters' rank (the slot's x·Aᵀ and h·Bᵀ).
  FLUX's 64-channel x_embedder and proj_out match rank 64 too: two small GEMMs a step, in every variant;
- `gemm`: every other GEMM (cuBLAS/cuBLASLt, CUTLASS, nvjet, inductor templates, _scaled_mm) and the
  convolutions (implicit GEMMs: the VAE's);
- `other`: the rest.

Idle per step: the kernels launched between two step-end marks (`gpu_check.step_end`, the step callback) are that
step's; a step's span on the device runs from its first kernel's start to the next step's first kernel's start
(the last step's to its own last kernel's end), and its idle time is that span less the union of the kernels inside.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from typing import NamedTuple

KINDS = ("gemm", "attention", "lora_factors", "merge", "elementwise", "other")
# The marks the check puts into the profile (zero-length record_function ranges) and this module reads back.
SWAP_BEGINS = "gpu_check.swap_begins"
SWAP_DONE = "gpu_check.swap_done"
STEP_END = "gpu_check.step_end"

_ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "mha_")
_GEMM_WORDS = ("gemm", "xmma", "cutlass", "cublas", "nvjet", "wgmma", "_scaled_mm", "triton_tem", "matmul", "sm90_")
_GEMM_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm",
    "aten::addbmm", "aten::_addmm_activation", "aten::_int_mm", "aten::_weight_int8pack_mm",
    # Convolutions run as implicit GEMMs (the VAE's): counted with them.
    "aten::conv2d", "aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
    "aten::mkldnn_convolution", "aten::_slow_conv2d_forward",
)  # fmt: skip
_GENERATED_ELEMENTWISE = ("triton_poi", "triton_per", "triton_red")
_COPIES = ("memcpy", "memset")
_ELEMENTWISE_WORDS = ("elementwise", "vectorized", "reduce_kernel", "copy", "norm", "gelu", "silu", "softmax")
NAME_CHARS = 160  # kernel names (C++ templates) are cut to this many characters in the JSON
LISTED = 8  # attention kernels and top kernels listed


class KernelRecord(NamedTuple):
    """One kernel (on a CPU: one outermost aten op); times in microseconds."""

    name: str
    start: float
    end: float
    shapes: Sequence = ()
    op: str = ""  # the aten op (or record_function range) that launched it; "" when unknown
    launched: float | None = None  # when the host launched it; None: unknown (in no swap and no step's group)


def kind_of(record: KernelRecord, *, rank: int | None = None, in_swap: bool = False) -> str:
    """The kind of one kernel (see the module's docstring for the order the rules are asked in)."""
    if in_swap:
        return "merge"
    name = record.name.lower()
    text = f"{record.op.lower()} {name}"
    if name.startswith(_COPIES) or "memcpy" in name or "memset" in name:
        return "other"
    if name.startswith(_GENERATED_ELEMENTWISE):
        return "elementwise"
    if any(word in text for word in _ATTENTION_WORDS):
        return "attention"
    if record.op in _GEMM_OPS or any(word in name for word in _GEMM_WORDS):
        return "lora_factors" if rank and _has_dimension(record.shapes, rank) else "gemm"
    if any(word in text for word in _ELEMENTWISE_WORDS) or record.op.startswith("aten::"):
        return "elementwise"
    return "other"


def _has_dimension(shapes: Sequence, size: int) -> bool:
    """Whether a 2-D or 3-D input among `shapes` has a dimension of `size` (a LoRA factor's rank)."""
    return any(len(shape) in (2, 3) and size in shape for shape in shapes if isinstance(shape, (list, tuple)))


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _within(record: KernelRecord, begin: float, end: float, *, closed: bool = True) -> bool:
    """Whether the host launched `record` between two host times (a record with no launch time is in no window)."""
    if record.launched is None:
        return False
    return begin <= record.launched <= end if closed else begin < record.launched <= end


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def summarise(
    records: Iterable[KernelRecord | tuple],
    *,
    rank: int | None = None,
    swap: tuple[float, float] | None = None,
    step_ends: Sequence[float] = (),
) -> dict:
    """Summarise one profiled request's kernels.

    `rank`: the adapters' rank (None: no LoRA factors to look for); `swap`: the host-time window the swap's kernels
    were launched in (None: no swap); `step_ends`: the host times the step callback ran at, in order.

    Returns `kernel_ms` and `kernel_count` per kind (every kind of KINDS, zeros included), `busy_ms` (the union of
    all kernels), `steps_measured`, `step_ms` and `idle_ms_per_step` (medians over the steps measured; None when
    no step could be placed), `idle_share` (idle over span, those steps together), `attention_kernels` (their
    names, most time first) and `top_kernels` (name, kind, ms, count).
    """
    kernels = [KernelRecord(*record) for record in records]
    kinds = [kind_of(kernel, rank=rank, in_swap=swap is not None and _within(kernel, *swap)) for kernel in kernels]
    kernel_us = dict.fromkeys(KINDS, 0.0)
    kernel_count = dict.fromkeys(KINDS, 0)
    by_name: dict[str, list] = {}
    for kernel, kind in zip(kernels, kinds, strict=True):
        duration = max(0.0, kernel.end - kernel.start)
        kernel_us[kind] += duration
        kernel_count[kind] += 1
        entry = by_name.setdefault(kernel.name, [kind, 0.0, 0])
        entry[1] += duration
        entry[2] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    steps = _step_spans([k for k, kind in zip(kernels, kinds, strict=True) if kind != "merge"], step_ends)
    return {
        "kernel_ms": {kind: _ms(us) for kind, us in kernel_us.items()},
        "kernel_count": kernel_count,
        "busy_ms": _ms(_union_us((k.start, k.end) for k in kernels)),
        "steps_measured": len(steps),
        "step_ms": _ms(statistics.median(span for span, _ in steps)) if steps else None,
        "idle_ms_per_step": _ms(statistics.median(idle for _, idle in steps)) if steps else None,
        "idle_share": round(sum(idle for _, idle in steps) / sum(span for span, _ in steps), 4)
        if steps and sum(span for span, _ in steps) > 0
        else None,
        "attention_kernels": [name[:NAME_CHARS] for name, (kind, _, _) in ranked if kind == "attention"][:LISTED],
        "top_kernels": [
            {"name": name[:NAME_CHARS], "kind": kind, "ms": _ms(us), "count": count}
            for name, (kind, us, count) in ranked[:LISTED]
        ],
    }


def _step_spans(kernels: list[KernelRecord], step_ends: Sequence[float]) -> list[tuple[float, float]]:
    """(span, idle) in microseconds of each step after the first whose kernels can be told apart by the marks: the
    kernels launched after mark i-1 and up to mark i are step i's (the first step's start is not marked: the prompt
    encoding comes before it unmarked)."""
    groups: list[list[KernelRecord]] = []
    for before, after in itertools.pairwise(step_ends):
        group = [kernel for kernel in kernels if _within(kernel, before, after, closed=False)]
        if group:
            groups.append(group)
    spans = []
    for index, group in enumerate(groups):
        begin = min(kernel.start for kernel in group)
        if index + 1 < len(groups):
            finish = min(kernel.start for kernel in groups[index + 1])
        else:
            finish = max(kernel.end for kernel in group)
        if finish <= begin:
            continue
        busy = _union_us(
            (max(k.start, begin), min(k.end, finish)) for k in kernels if k.end > begin and k.start < finish
        )
        spans.append((finish - begin, max(0.0, finish - begin - busy)))
    return spans


# -- from a torch.profiler profile to records -----------------------------------------------------------------------


def records_from_profile(prof, *, device_type: str) -> tuple[list[KernelRecord], dict[str, list[float]]]:
    """The kernels of a finished torch.profiler profile as records, and the check's marks (name -> host times, µs).

    On CUDA each kernel is linked to the op that launched it (the profiler's correlation ids): its shapes and name,
    and the launch call's start as its launch time. On a CPU the outermost aten ops are the records.
    """
    events = prof.profiler.kineto_results.events()
    marks: dict[str, list[float]] = {SWAP_BEGINS: [], SWAP_DONE: [], STEP_END: []}
    ops: dict[int, object] = {}  # the ops (and ranges) the host ran, by their own correlation id
    launches: dict[int, object] = {}  # the launch calls (cudaLaunchKernel, cuLaunchKernel, ...), by the kernel's id
    host = []
    device = []
    for event in events:
        if _on_device(event):
            # The device's copies of record_function ranges (gpu_user_annotation) span kernels: they are none.
            if not _annotation(event):
                device.append(event)
            continue
        name = event.name()
        if name in marks:
            marks[name].append(event.start_ns() / 1000.0)
            continue
        if _launch_call(event):
            launches[event.correlation_id()] = event
        else:
            host.append(event)
            if event.linked_correlation_id() == 0:
                ops[event.correlation_id()] = event
    for times in marks.values():
        times.sort()
    if device_type != "cpu":
        return _kernel_records(device, launches, ops), marks
    return _outer_op_records(host), marks


def _on_device(event) -> bool:
    return str(event.device_type()).rsplit(".", 1)[-1] != "CPU"


def _activity(event) -> str | None:
    """The profiler's kind of event (cpu_op, cuda_runtime, kernel, gpu_user_annotation, ...); None where this
    torch does not say."""
    activity = getattr(event, "activity_type", None)
    return str(activity()) if callable(activity) else None


def _launch_call(event) -> bool:
    """Whether a host event is a call of the CUDA runtime or driver (a kernel's launch shares its correlation id):
    by its activity, else by its link to an op (ops have none), else by its name."""
    activity = _activity(event)
    if activity is not None:
        return "runtime" in activity or "driver" in activity
    return event.linked_correlation_id() != 0 or event.name().startswith(("cuda", "cu"))


def _annotation(event) -> bool:
    """Whether a device event is a range's annotation rather than work (asked of the profiler's activity type where
    this torch has it)."""
    activity = _activity(event)
    if activity is not None:
        return "annotation" in activity
    user = getattr(event, "is_user_annotation", None)
    return bool(user()) if callable(user) else False


def _kernel_records(device: list, launches: dict[int, object], ops: dict[int, object]) -> list[KernelRecord]:
    records = []
    for kernel in device:
        launch = launches.get(kernel.correlation_id())
        op = ops.get(kernel.linked_correlation_id())
        if launch is not None:
            launched = launch.start_ns() / 1000.0
        elif op is not None:
            launched = op.start_ns() / 1000.0
        else:
            launched = None
        records.append(
            KernelRecord(
                name=kernel.name(),
                start=kernel.start_ns() / 1000.0,
                end=kernel.end_ns() / 1000.0,
                shapes=tuple(tuple(shape) for shape in (op.shapes() if op is not None else ())),
                op=op.name() if op is not None else "",
                launched=launched,
            )
        )
    return records


def _outer_op_records(host: list) -> list[KernelRecord]:
    """The aten ops that no aten op holds (on their thread): on a CPU, the work as the model asked for it (an
    aten::linear, not the aten::mm and views inside it)."""
    ops = sorted(
        (event for event in host if event.name().startswith("aten::")),
        key=lambda event: (event.start_thread_id(), event.start_ns(), -event.end_ns()),
    )
    records = []
    reach: tuple[int, int] | None = None  # (thread, end) of the last outer op
    for op in ops:
        if reach is not None and reach[0] == op.start_thread_id() and op.start_ns() < reach[1]:
            continue
        reach = (op.start_thread_id(), op.end_ns())
        start, end = op.start_ns() / 1000.0, op.end_ns() / 1000.0
        shapes = tuple(tuple(shape) for shape in op.shapes())
        records.append(KernelRecord(op.name(), start, end, shapes, op.name(), start))
    return records
