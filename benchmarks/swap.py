"""Adapter swap cost, side by side in one process: diffusers' paths, loraswap's, and the copy floors.

    python -m benchmarks.swap                      # SDXL UNet (full size, random, bf16), rank 32, + mixed 8/64
    python -m benchmarks.swap --rank 8 --mixed-ranks ""
    python -m benchmarks.swap --model random-flux --layers 8

Every path swaps between two adapters of the same rank (the headline), then
again between two of different ranks (reported under "mixed_rank"). The
stack paths swap between two stacks of `--stack-members` adapters of rank
rank / members on the same layers, so that a stack holds the bytes of one
headline adapter (reported under "stack"). The fused path merges each adapter into
the base weights instead (W0 + B A from pristine copies, float32, one rounding;
adapters/residency/fused.py), beside its own floor (copy W0 into the touched weights, plus the
factors' product in float32). Each swap
is timed with perf_counter around the whole path, from "a different adapter
is wanted" to "the model would now run with it". The first swap of each path
on a clean model is reported apart ("first_swap_s"); then one warm-up swap is
dropped and `--repeats` swaps are kept. The last line printed is one JSON
object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# torch is imported where it is used, so that `--help` (and a script that imports this module's helpers) starts
# in a fraction of a second instead of the seconds torch takes to import.
if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "random-sdxl"
DEFAULT_RANK = 32
DEFAULT_MIXED_RANKS = (8, 64)
DEFAULT_REPEATS = 7
DEFAULT_STACK_MEMBERS = 2
# One thread: the dev machines have two shared cores, and one thread keeps the figures stable.
DEFAULT_THREADS = 1
ADAPTER_WEIGHT_NAME = "pytorch_lora_weights.safetensors"

# "The attention projections": what most published LoRAs train, and what the
# issue's 90 MB-at-rank-32 SDXL figure counts.
ATTENTION_PROJECTIONS = {
    "sdxl": ("to_q", "to_k", "to_v", "to_out.0"),
    "flux": ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
}

PATHS = (
    "diffusers_load_unload",
    "diffusers_fuse_unfuse",
    "diffusers_hotswap",
    "loraswap_cold",
    "loraswap_warm",
    "floor_copy",
    "floor_read_copy",
    "loraswap_fuse",
    "floor_fuse",
)
# The paths that merge into the base weights: they need the pristine copies of the slot layers' weights.
FUSE_PATHS = ("loraswap_fuse", "floor_fuse")
# Paths measured round by round together with their floor (SwapBench.measure_interleaved), so that whatever else
# the machine does hits a ratio's two sides alike.
INTERLEAVED = (("loraswap_cold", "floor_read_copy"), FUSE_PATHS)
# Fused swaps timed under torch.profiler for --profile-fuse (the op breakdown of FusedWeights.merge).
PROFILED_FUSE_SWAPS = 4
# Measured over a pair of stacks (tuples of adapter files) instead of a pair of adapters.
STACK_PATHS = ("loraswap_stack", "floor_copy_stack")


def log(message: str) -> None:
    """Progress to stderr, so stdout's last line stays the JSON result."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min and max of timings in seconds (and how many there were)."""
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "n": len(samples),
    }


def summarize_swaps(samples: list[tuple[float, float]]) -> dict[str, float]:
    """`summarize` of the wall-clock seconds of (wall, CPU) samples, plus the median CPU seconds of the measuring
    thread (time.thread_time: with one torch thread all the work is on it), which another process on the same
    cores inflates far less than the wall clock."""
    return {**summarize([wall for wall, _ in samples]), "cpu_median_s": statistics.median(cpu for _, cpu in samples)}


def timed(function: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and this thread's CPU seconds of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    function()
    return time.perf_counter() - wall, time.thread_time() - cpu


def machine_info() -> dict[str, object]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = None
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import diffusers
    import peft
    import torch

    return {
        "cpu": cpu,
        "cores_available": cores,
        "memory_gb": memory_gb,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "peft": peft.__version__,
    }


def build_pipeline(model: str, dtype: torch.dtype, layers: int | None):
    """A built-in pipeline: a tiny one or a random full-size one (the real denoiser architecture)."""
    from loraswap.server.engine.models import BUILTINS

    if model not in BUILTINS:
        raise SystemExit(f"unknown --model {model!r}; use one of {', '.join(BUILTINS)}")
    try:
        return BUILTINS[model].build(dtype, layers)
    except ValueError as exc:  # --layers where the model takes none, or out of range
        raise SystemExit(str(exc)) from exc


def random_lora_factors(denoiser, layer_names: list[str], rank: int, seed: int):
    """(layer name, lora_A, lora_B) for each layer: random rank-`rank` factors in the denoiser's dtype, A scaled
    by 1/sqrt(in_features), B small, so the adapter changes the image without blowing it up."""
    import torch

    generator = torch.Generator("cpu").manual_seed(seed)
    for name in layer_names:
        layer = denoiser.get_submodule(name)
        a = torch.randn(rank, layer.in_features, generator=generator) / layer.in_features**0.5
        b = torch.randn(layer.out_features, rank, generator=generator) * 0.01
        yield name, a.to(denoiser.dtype), b.to(denoiser.dtype)


def write_lora_file(
    pipe, layer_names: list[str], directory: Path, *, rank: int, patterns: tuple[str, ...], seed: int
) -> Path:
    """Write a random rank-`rank` LoRA on `layer_names` in diffusers' PEFT format, as `save_lora_weights` does.

    The factors are drawn directly (no PEFT layers are put on the model), so
    writing adapters for a 2.6 B-parameter UNet costs only the file's bytes.
    """
    from peft import LoraConfig

    from loraswap.server.engine.families import family_of

    traits = family_of(pipe)
    denoiser = traits.denoiser(pipe)
    state_dict = {}
    for name, a, b in random_lora_factors(denoiser, layer_names, rank, seed):
        state_dict[f"{name}.lora_A.weight"] = a
        state_dict[f"{name}.lora_B.weight"] = b
    metadata = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(patterns), init_lora_weights=False).to_dict()
    traits.save_lora_weights(directory, state_dict, metadata)
    return directory / ADAPTER_WEIGHT_NAME


# LyCORIS kinds measured fused against the headline LoRA (--kinds): each kind's layers, as kohya/LyCORIS files
# name them (`lora_unet_<module path>`). LoCon adds the resnets' convs and time_emb_proj to the attention layers.
KINDS = ("loha", "lokr", "locon")
RESNET_LAYERS = ("conv1", "conv2", "conv_shortcut", "time_emb_proj")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS's split of a LoKr dimension into (m, n), m <= n, m * n = dimension: the most even one when factor
    is -1, else m as close to factor as the dimension allows (lycoris/functional/general.py)."""
    if factor > 0 and dimension % factor == 0:
        return tuple(sorted((factor, dimension // factor)))
    factor = dimension if factor < 0 else factor
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > m + n or new_m > factor:
            break
        m, n = new_m, new_n
    return (m, n) if m <= n else (n, m)


def kind_layers(denoiser, kind: str, attention: list[str]) -> list[str]:
    """The layers a file of `kind` changes: the attention projections, and for LoCon the resnets' layers too."""
    if kind != "locon":
        return attention
    return attention + sorted(name for name, _ in denoiser.named_modules() if ".resnets." in name
                              and name.rsplit(".", 1)[-1] in RESNET_LAYERS)  # fmt: skip


def write_kind_file(denoiser, layer_names: list[str], directory: Path, *, kind: str, rank: int, seed: int) -> Path:
    """A random LyCORIS file of `kind` (KINDS) on `layer_names`, in the tensor names and shapes LyCORIS writes
    (alpha = rank; LoKr with LyCORIS's default factorization, w2 decomposed where the rank is below half its
    side), its factors drawn directly like write_lora_file's."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator("cpu").manual_seed(seed)

    def draw(*shape, scale):
        return (torch.randn(*shape, generator=generator) * scale).to(denoiser.dtype)

    tensors = {}
    for name in layer_names:
        weight = denoiser.get_submodule(name).weight
        out_features, in_features, window = weight.shape[0], weight.shape[1], tuple(weight.shape[2:])
        fan_in = in_features * (weight[0, 0].numel() if window else 1)
        prefix = "lora_unet_" + name.replace(".", "_")
        layer = {"alpha": torch.tensor(float(rank))}
        if kind == "loha":
            for side in ("1", "2"):
                layer[f"hada_w{side}_a"] = draw(out_features, rank, scale=0.1)
                layer[f"hada_w{side}_b"] = draw(rank, fan_in, scale=fan_in**-0.5)
        elif kind == "lokr":
            (out_m, out_n), (in_m, in_n) = factorization(out_features), factorization(in_features)
            layer["lokr_w1"] = draw(out_m, in_m, scale=0.1)
            if rank < max(out_n, in_n) / 2:
                layer["lokr_w2_a"] = draw(out_n, rank, scale=0.1)
                layer["lokr_w2_b"] = draw(rank, in_n * (weight[0, 0].numel() if window else 1), scale=in_n**-0.5)
            else:
                layer["lokr_w2"] = draw(out_n, in_n, *window, scale=in_n**-0.5)
        else:
            layer["lora_down.weight"] = draw(rank, in_features, *window, scale=fan_in**-0.5)
            layer["lora_up.weight"] = draw(out_features, rank, *((1,) * len(window)), scale=0.01)
        tensors |= {f"{prefix}.{key}": value.contiguous() for key, value in layer.items()}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ADAPTER_WEIGHT_NAME  # the name diffusers' load_lora_weights looks for in a directory
    save_file(tensors, str(path))
    return path


class SwapBench:
    """One pipeline, its adapters on disk, and a timed run of each swap path over a pair of adapters."""

    def __init__(self, pipe, traits, layer_names: list[str], max_rank: int, repeats: int) -> None:
        self.pipe = pipe
        self.family = traits.family
        self.denoiser = traits.denoiser(pipe)
        self.component = traits.denoiser_attribute
        self.layer_names = layer_names
        self.max_rank = max_rank
        self.repeats = repeats
        self.dtype = self.denoiser.dtype
        self.residency = None
        self.spec = None
        self.canonical: dict[str, object] = {}

    # -- the timing protocol ------------------------------------------------------------------------

    def measure(
        self, pair: tuple[Path, Path], first: Callable[[Path], None], swap: Callable[[Path], None]
    ) -> tuple[float, list[tuple[Path, float, float]]]:
        """`first` loads pair[0] on a clean model (timed alone); then 1 + repeats alternating swaps, the first dropped.

        Returns the first swap's seconds and (adapter swapped to, wall seconds, CPU seconds) for each kept swap.
        """
        first_s, _ = timed(lambda: first(pair[0]))
        samples = []
        for index in range(1 + self.repeats):
            target = pair[(index + 1) % 2]
            elapsed, cpu = timed(lambda: swap(target))  # noqa: B023 (called at once)
            if index > 0:
                samples.append((target, elapsed, cpu))
        return first_s, samples

    def measure_interleaved(
        self, paths: dict[str, tuple[tuple, Callable[[Path], None], Callable[[Path], None]]]
    ) -> dict[str, tuple[float, list[tuple[Path, float, float]]]]:
        """`measure` for several paths at once (name -> (its pair, first, swap)), round by round: each path's
        `first` in turn, then 1 + repeats rounds in which every path swaps to its pair's other adapter, the
        order rotated every round (the first round dropped), so that whatever else the machine runs hits them
        alike. For paths whose costs do not depend on one another's state."""
        first_s = {name: timed(lambda: first(pair[0]))[0] for name, (pair, first, _) in paths.items()}  # noqa: B023
        samples: dict[str, list[tuple[Path, float, float]]] = {name: [] for name in paths}
        names = list(paths)
        for index in range(1 + self.repeats):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                target = paths[name][0][(index + 1) % 2]
                elapsed, cpu = timed(lambda: paths[name][2](target))  # noqa: B023 (called at once)
                if index > 0:
                    samples[name].append((target, elapsed, cpu))
        return {name: (first_s[name], samples[name]) for name in names}

    # -- diffusers' paths ----------------------------------------------------------------------------

    def diffusers_load_unload(self, pair):
        def first(path):
            self.pipe.load_lora_weights(str(path.parent), adapter_name="bench")

        def swap(path):
            self.pipe.unload_lora_weights()
            self.pipe.load_lora_weights(str(path.parent), adapter_name="bench")

        try:
            return self.measure(pair, first, swap)
        finally:
            self.pipe.unload_lora_weights()

    def diffusers_fuse_unfuse(self, pair):
        def first(path):
            self.pipe.load_lora_weights(str(path.parent), adapter_name="bench")
            self.pipe.fuse_lora()

        def swap(path):
            self.pipe.unfuse_lora()
            self.pipe.unload_lora_weights()
            self.pipe.load_lora_weights(str(path.parent), adapter_name="bench")
            self.pipe.fuse_lora()

        try:
            return self.measure(pair, first, swap)
        finally:
            self.pipe.unfuse_lora()
            self.pipe.unload_lora_weights()

    def diffusers_hotswap(self, pair):
        # Must precede the first load: pads every adapter to max_rank so later swaps keep shapes.
        self.pipe.enable_lora_hotswap(target_rank=self.max_rank)

        def first(path):
            self.pipe.load_lora_weights(str(path.parent), adapter_name="bench")

        def swap(path):
            self.pipe.load_lora_weights(str(path.parent), adapter_name="bench", hotswap=True)

        try:
            return self.measure(pair, first, swap)
        finally:
            self.pipe.unload_lora_weights()

    # -- loraswap's paths ----------------------------------------------------------------------------

    def install_slot(self, fuse: bool) -> tuple[float, float]:
        """Put loraswap's max-rank placeholder on the layers (start-up work, like the server's) and, with `fuse`,
        keep the pristine copies of their base weights that fused swaps merge from (as --fuse auto|always does);
        returns the seconds of each."""
        import torch

        from loraswap.server.engine.adapters.formats import ModelLayers
        from loraswap.server.engine.adapters.residency import (
            AdapterResidency,
            FusedWeights,
            HotswapSlot,
            PristineWeights,
        )

        model_layers = ModelLayers.of({self.component: self.denoiser})  # before the slot wraps its layers
        started = time.perf_counter()
        slot = HotswapSlot.install(self.denoiser, self.layer_names, self.max_rank, self.dtype, torch.device("cpu"))
        installed = time.perf_counter()
        fused = None
        if fuse:
            pristine = PristineWeights(model_layers, keep=[(self.component, name) for name in self.layer_names])
            fused = FusedWeights(pristine, frozenset({self.component}), self.component)
        self.residency = AdapterResidency(slot, fused)
        self.spec = self.residency.spec(self.family, self.dtype, torch.device("cpu"), model_layers)
        return installed - started, time.perf_counter() - installed

    @property
    def pristine_bytes(self) -> int:
        """Bytes of the pristine copies (0 when no fused path runs)."""
        fused = self.residency.fused_weights if self.residency is not None else None
        return fused.pristine.nbytes if fused is not None else 0

    def _load_canonical(self, path: Path):
        from loraswap.server.engine.adapters.formats import load_canonical
        from loraswap.server.engine.adapters.sources import AdapterFile

        return load_canonical(AdapterFile(name=path.parent.name, path=path, source="local"), self.spec)

    def loraswap_cold(self, pair):
        """`load_canonical` of the file then the slot's load: file to ready. Returns (first, swap) for
        `interleaved`."""
        import torch

        def swap(path):
            with torch.inference_mode():
                self.residency.load_stack(((self._load_canonical(path), 1.0),))

        return swap, swap

    def loraswap_stack(self, pair):
        """`AdapterResidency.load_stack` of canonical adapters in host memory: the cache to a whole stack ready."""
        import torch

        for stack in pair:
            for path in stack:
                self.canonical.setdefault(str(path), self._load_canonical(path))
        self.residency.load_stack(())

        def swap(stack):
            with torch.inference_mode():
                self.residency.load_stack([(self.canonical[str(path)], 1.0) for path in stack])

        return self.measure(pair, swap, swap)

    def loraswap_warm(self, pair):
        import torch

        # The host-memory cache holds canonical adapters; a warm swap starts from one of them.
        for path in pair:
            self.canonical.setdefault(str(path), self._load_canonical(path))
        self.residency.load_stack(())  # the base model resident, as after start-up

        def swap(path):
            with torch.inference_mode():
                self.residency.load_stack(((self.canonical[str(path)], 1.0),))

        return self.measure(pair, swap, swap)

    def interleaved(self, pair, names: tuple[str, ...]) -> dict[str, tuple[float, list[tuple[Path, float, float]]]]:
        """Paths of one INTERLEAVED group, measured round by round together (`measure_interleaved`). None depends
        on what another leaves: a floor writes into tensors of its own or W0 into weights a merge writes whole
        from W0, and each of loraswap's paths makes the model hold what it swapped to. The base model is
        resident before and after."""
        self.residency.load_stack(())
        try:
            paths = {name: (pair, *getattr(self, name)(pair)) for name in names}
            return self.measure_interleaved(paths)
        finally:
            self.residency.load_stack(())  # W0 back in every base weight, for the paths after these

    def loraswap_fuse(self, pair):
        """`AdapterResidency.load_stack(((adapter, 1.0),), fused=True)` of an adapter in canonical form in host memory:
        the cache to ready with the adapter merged into the base weights of the layers it touches (W0 + B A, from
        the pristine copies, accumulated in float32 and rounded once), what a fused swap in the server does.
        Returns (first, swap) for `interleaved`."""
        import torch

        for path in pair:
            self.canonical.setdefault(str(path), self._load_canonical(path))

        def swap(path):
            with torch.inference_mode():
                self.residency.load_stack(((self.canonical[str(path)], 1.0),), fused=True)

        return swap, swap

    def profile_fuse(self, pair) -> dict[str, object]:
        """FusedWeights.merge under torch.profiler over PROFILED_FUSE_SWAPS fused swaps alternating over the pair:
        each aten op's self CPU time and calls per swap, largest first, beside the swaps' wall time."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        for path in pair:
            self.canonical.setdefault(str(path), self._load_canonical(path))
        self.residency.load_stack(())
        with torch.inference_mode():
            # Untimed: the scratch's pages.
            self.residency.load_stack(((self.canonical[str(pair[0])], 1.0),), fused=True)
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as profiler, torch.inference_mode():
            for index in range(PROFILED_FUSE_SWAPS):
                self.residency.load_stack(((self.canonical[str(pair[(index + 1) % 2])], 1.0),), fused=True)
        wall_ms = (time.perf_counter() - started) * 1000.0 / PROFILED_FUSE_SWAPS
        self.residency.load_stack(())
        ops = sorted(profiler.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
        return {
            "swaps": PROFILED_FUSE_SWAPS,
            "wall_ms_per_swap_profiled": wall_ms,
            "self_cpu_ms_per_swap": {
                event.key: {
                    "ms": event.self_cpu_time_total / 1000.0 / PROFILED_FUSE_SWAPS,
                    "calls": event.count / PROFILED_FUSE_SWAPS,
                }
                for event in ops
                if event.self_cpu_time_total > 0
            },
        }

    def fused_kinds(self, headline: tuple[Path, Path], kinds: dict[str, tuple[Path, Path]]) -> dict[str, object]:
        """Fused swaps of each LyCORIS kind's pair beside the headline LoRA's, round by round together: per path
        the swap summary and the base-weight bytes a swap reads and writes (`fused_weight_bytes`); per kind its
        swap's cost per touched byte over the LoRA's (`over_lora_per_byte`: for LoHa and LoKr, which change the
        LoRA's layers, the plain ratio)."""
        import torch

        adapters = {str(path): self._load_canonical(path) for pair in (headline, *kinds.values()) for path in pair}
        fused = self.residency.fused_weights

        def swap(path):
            with torch.inference_mode():
                self.residency.load_stack(((adapters[str(path)], 1.0),), fused=True)

        pairs = {"loraswap_fuse": headline} | {f"loraswap_fuse_{kind}": pair for kind, pair in kinds.items()}
        self.residency.load_stack(())
        try:
            measured = self.measure_interleaved({name: (pair, swap, swap) for name, pair in pairs.items()})
        finally:
            self.residency.load_stack(())
        paths = {}
        for name, (first_s, samples) in measured.items():
            paths[name] = summarize_swaps([(wall, cpu) for _, wall, cpu in samples]) | {
                "first_swap_s": first_s,
                "fused_weight_bytes": fused.merge_bytes(((adapters[str(pairs[name][0])], 1.0),)),
                "adapter_file_bytes": pairs[name][0].stat().st_size,
                "adapter_kinds": list(adapters[str(pairs[name][0])].kinds),
            }
            log(f"  {name}: first {first_s:.4f} s, median {paths[name]['median_s']:.4f} s")
        lora = paths["loraswap_fuse"]
        per_byte = lora["median_s"] / lora["fused_weight_bytes"]
        return {
            "paths": paths,
            "over_lora_per_byte": {
                kind: paths[f"loraswap_fuse_{kind}"]["median_s"] / paths[f"loraswap_fuse_{kind}"]["fused_weight_bytes"]
                / per_byte
                for kind in kinds
            },
            "pristine_bytes": fused.pristine.nbytes,
        }

    def diffusers_kinds(self, kinds: dict[str, tuple[Path, Path]]) -> dict[str, object]:
        """For each kind, whether diffusers' load_lora_weights reads its file on the clean model and, where it does,
        its fuse/unfuse swap between the kind's pair (`diffusers_fuse_unfuse`); the error where it does not."""
        results = {}
        for kind, pair in kinds.items():
            try:
                self.pipe.load_lora_weights(str(pair[0].parent), adapter_name="probe")
            except Exception as exc:  # noqa: BLE001 (whatever diffusers raises for a layout it does not read says so)
                results[kind] = {"loads": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                self.pipe.unload_lora_weights()
                log(f"  diffusers cannot load the {kind} file: {results[kind]['error'][:120]}")
                continue
            self.pipe.unload_lora_weights()
            first_s, samples = self.diffusers_fuse_unfuse(pair)
            results[kind] = {"loads": True, "diffusers_fuse_unfuse": summarize_swaps(
                [(wall, cpu) for _, wall, cpu in samples]) | {"first_swap_s": first_s}}  # fmt: skip
            log(f"  diffusers_fuse_unfuse of {kind}: median {results[kind]['diffusers_fuse_unfuse']['median_s']:.4f} s")
        return results

    # -- the floors ----------------------------------------------------------------------------------

    def floor_copy(self, pair):
        """copy_ of the adapter's own tensors (canonical form) into preallocated tensors of the same shapes."""
        import torch

        sources = {}
        for item in pair:
            paths = item if isinstance(item, tuple) else (item,)  # a stack: all its members' tensors
            canonical = [self.canonical.get(str(path)) or self._load_canonical(path) for path in paths]
            sources[item] = [
                t for adapter in canonical for layer in adapter.layers.values() for t in (layer.a, layer.b)
            ]
        targets = {path: [torch.empty_like(t) for t in tensors] for path, tensors in sources.items()}
        for path in pair:  # touch the pages once: the slot's memory is resident too
            for target in targets[path]:
                target.zero_()

        @torch.no_grad()
        def swap(path):
            for target, source in zip(targets[path], sources[path], strict=True):
                target.copy_(source)

        return self.measure(pair, swap, swap)

    def floor_copy_stack(self, pair):
        """The floor copy of a stack's bytes: every member's tensors copied as `floor_copy` copies one adapter's."""
        return self.floor_copy(pair)

    def floor_fuse(self, pair):
        """The least an exact fused swap can cost, measured like the others: for each layer the adapter touches,
        one `torch.addmm(W0, B, A, out=weight)` in the model's dtype over the whole layer (reading W0, the product,
        writing the weight: the CPU's product accumulates in float32 and rounds once). What the merge adds to it:
        its row blocks, the finiteness check and its bookkeeping (and, for stacks at several strengths or other
        kinds, the float32 block it accumulates in). Returns (first, swap) for `interleaved`."""
        import torch

        pristine = self.residency.fused_weights.pristine
        plans = {}
        for path in pair:
            adapter = self.canonical.get(str(path)) or self._load_canonical(path)
            plans[path] = [
                (pristine.layers[self.component, name].weight, pristine.weights[self.component, name], layer.b, layer.a)
                for name, layer in sorted(adapter.layers.items())
            ]

        @torch.no_grad()
        def swap(path):
            for weight, w0, b, a in plans[path]:
                torch.addmm(w0, b, a, out=weight)

        return swap, swap

    def floor_read_copy(self, pair):
        """safetensors.torch.load_file of the adapter file plus the floor copy of its tensors. Returns (first,
        swap) for `interleaved`."""
        import torch
        from safetensors.torch import load_file

        targets = {path: {k: torch.zeros_like(v) for k, v in load_file(str(path)).items()} for path in pair}

        @torch.no_grad()
        def swap(path):
            for key, source in load_file(str(path)).items():
                targets[path][key].copy_(source)

        return swap, swap

    # -- recompilation check -------------------------------------------------------------------------

    def count_recompilations(
        self, adapters: list[Path | tuple[Path, ...]], backend: str, size: int, fused: list[Path] = ()
    ) -> dict[str, object]:
        """Compile the denoiser (slot in place), run once per rank bucket, then after each swap to `adapters`, each
        fused swap to `fused`, and the swap back to the base model.

        Returns the graphs compiled after the first run: a swap that changed a
        shape, a dtype or a guarded attribute would show up here.
        """
        import torch

        from loraswap.server.engine.pipeline.compile import CountingBackend

        counter = CountingBackend(backend)
        self.denoiser.compile(backend=counter)
        kwargs = dict(
            prompt="recompilation check", num_inference_steps=1, width=size, height=size, output_type="latent"
        )
        if self.family.value == "flux":
            kwargs["max_sequence_length"] = 32
        started = time.perf_counter()
        with torch.inference_mode():
            # As the server's warm-up does: one run per rank bucket (the base model's included), each its own graph.
            self.residency.load_stack(())
            for bucket in self.residency.slot.graph_buckets:
                with self.residency.computing_at(bucket):
                    self.pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0))
            at_ready = counter.graphs_compiled
            swaps = [(item, False) for item in adapters] + [(path, True) for path in fused] + [((), False)]
            for item, merged in swaps:
                paths = item if isinstance(item, tuple) else (item,)
                members = [(self.canonical.get(str(path)) or self._load_canonical(path), 1.0) for path in paths]
                self.residency.load_stack(members, fused=merged)
                self.pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0))
        return {
            "backend": backend,
            "graphs_at_ready": at_ready,
            "swaps_checked": len(swaps),
            "fused_swaps_checked": len(fused),
            "recompilations": counter.graphs_compiled - at_ready,
            "elapsed_s": time.perf_counter() - started,
        }


def _label(item: Path | tuple[Path, ...]) -> str:
    """An adapter's name, or a stack's members' names joined with '+'."""
    return "+".join(path.parent.name for path in item) if isinstance(item, tuple) else item.parent.name


def run_pair(bench: SwapBench, pair: tuple, paths: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """Each path over the pair: summaries over all swaps, first swaps, and summaries by the adapter swapped to.

    Each INTERLEAVED group is measured together, round by round (SwapBench.interleaved); the others one after
    another.
    """
    results, first, by_target = {}, {}, {}

    def record(name: str, first_s: float, samples: list[tuple[Path, float, float]]) -> None:
        results[name] = summarize_swaps([(wall, cpu) for _, wall, cpu in samples])
        first[name] = first_s
        by_target[name] = {
            f"to_{_label(item)}": summarize_swaps([(wall, cpu) for target, wall, cpu in samples if target == item])
            for item in pair
        }
        log(f"  {name}: first {first_s:.4f} s, median {results[name]['median_s']:.4f} s")

    grouped = {name for group in INTERLEAVED for name in group}
    for name in (path for path in paths if path not in grouped):
        log(f"  {name}: {_label(pair[0])} <-> {_label(pair[1])}")
        record(name, *getattr(bench, name)(pair))
    for group in INTERLEAVED:
        names = tuple(path for path in paths if path in group)
        if names:
            log(f"  {' and '.join(names)}, interleaved: {_label(pair[0])} <-> {_label(pair[1])}")
            for name, (first_s, samples) in bench.interleaved(pair, names).items():
                record(name, first_s, samples)
    return results, first, by_target


def ratios(paths: dict[str, dict], key: str = "median_s") -> dict[str, float | None]:
    """The claims, as ratios of medians measured in this one run (`key`: cpu_median_s for the CPU seconds')."""

    def ratio(numerator: str, denominator: str) -> float | None:
        if numerator not in paths or denominator not in paths:
            return None
        return paths[numerator][key] / paths[denominator][key]

    return {
        "diffusers_hotswap_over_loraswap_warm": ratio("diffusers_hotswap", "loraswap_warm"),
        "diffusers_load_unload_over_loraswap_warm": ratio("diffusers_load_unload", "loraswap_warm"),
        "diffusers_fuse_unfuse_over_loraswap_warm": ratio("diffusers_fuse_unfuse", "loraswap_warm"),
        "loraswap_warm_over_floor_copy": ratio("loraswap_warm", "floor_copy"),
        "loraswap_cold_over_floor_read_copy": ratio("loraswap_cold", "floor_read_copy"),
        "loraswap_fuse_over_floor": ratio("loraswap_fuse", "floor_fuse"),
        "diffusers_fuse_unfuse_over_loraswap_fuse": ratio("diffusers_fuse_unfuse", "loraswap_fuse"),
        "loraswap_fuse_over_loraswap_warm": ratio("loraswap_fuse", "loraswap_warm"),
    }


def _file_tensor_bytes(path: Path) -> int:
    import torch
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor_slice = handle.get_slice(key)
            shape = tensor_slice.get_shape()
            count = 1
            for dim in shape:
                count *= dim
            total += count * torch.finfo(getattr(torch, _dtype_name(tensor_slice.get_dtype()))).bits // 8
    return total


def _weight_bytes(denoiser, layer_names: list[str]) -> int:
    """Bytes of the named linear layers' weights (the slot's base layers once it is installed)."""
    total = 0
    for name in layer_names:
        module = denoiser.get_submodule(name)
        weight = module.base_layer.weight if hasattr(module, "base_layer") else module.weight
        total += weight.numel() * weight.element_size()
    return total


def _dtype_name(safetensors_dtype: str) -> str:
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[safetensors_dtype]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="random-sdxl, random-flux, tiny-sdxl or tiny-flux")
    parser.add_argument("--layers", type=int, default=None, help="random-flux only: double-stream blocks to keep")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help="rank of the headline same-rank pair")
    parser.add_argument(
        "--mixed-ranks", default=",".join(map(str, DEFAULT_MIXED_RANKS)), help="two ranks for the mixed pair; '' skips"
    )
    parser.add_argument("--max-rank", type=int, default=None, help="slot / hotswap target rank (default: highest rank)")
    parser.add_argument(
        "--stack-members",
        type=int,
        default=DEFAULT_STACK_MEMBERS,
        help="adapters in each stack of the stack paths, each of rank --rank / N; 0 skips the stack paths",
    )
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed swaps per path after 1 warm-up")
    parser.add_argument("--dtype", default="bfloat16", help="weights' dtype")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of the paths")
    parser.add_argument("--compile-backend", default="eager", help="backend of the recompilation check; 'none' skips")
    parser.add_argument("--check-size", type=int, default=None, help="check image size (32 SDXL, 16 Flux)")
    parser.add_argument(
        "--profile-fuse",
        action="store_true",
        help="also time the fused swap's ops under torch.profiler (the breakdown of FusedWeights.merge)",
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS),
        help="LyCORIS kinds whose fused swaps are measured beside the headline LoRA's (SDXL); '' skips",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch CPU threads")
    parser.add_argument("--adapter-dir", type=Path, default=None, help="where to write adapters (default: a temp dir)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    args.mixed = tuple(int(r) for r in args.mixed_ranks.split(",") if r.strip())
    if args.mixed and len(args.mixed) != 2:
        parser.error("--mixed-ranks takes two ranks, or '' to skip")
    args.path_list = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    args.kind_list = tuple(kind.strip() for kind in args.kinds.split(",") if kind.strip())
    if set(args.kind_list) - set(KINDS):
        parser.error(f"unknown kinds {sorted(set(args.kind_list) - set(KINDS))}; choose from {', '.join(KINDS)}")
    unknown = [p for p in args.path_list if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.stack_members < 0 or (args.stack_members and args.rank // args.stack_members < 1):
        parser.error("--stack-members must be 0 (skip) or at most --rank")
    return args


def in_process_prelude(threads: int) -> None:
    """What a benchmark that runs the engine in its own process sets first: torch's CPU threads, no Hub access,
    and quiet diffusers and dynamo (whose notes on diffusers' code say nothing about swaps)."""
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._dynamo")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the JSON result as the last line of stdout, and return it."""
    args = parse_args(argv)
    in_process_prelude(args.threads)
    import torch

    from loraswap.server.app import freeze_start_up_objects
    from loraswap.server.engine.families import family_of
    from loraswap.server.engine.pipeline.target_layers import resolve_target_layers

    run_started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    pipe = build_pipeline(args.model, dtype, args.layers)
    pipe.set_progress_bar_config(disable=True)
    build_s = time.perf_counter() - started
    traits = family_of(pipe)
    family = traits.family
    denoiser = traits.denoiser(pipe)
    denoiser.requires_grad_(False)
    patterns = ATTENTION_PROJECTIONS[family.value]
    layer_names = resolve_target_layers(denoiser, patterns)
    log(f"{args.model}: {sum(p.numel() for p in denoiser.parameters()) / 1e9:.2f} B denoiser parameters, "
        f"{len(layer_names)} attention projections, built in {build_s:.1f} s")  # fmt: skip

    ranks = {args.rank, *args.mixed}
    max_rank = args.max_rank or max(ranks)
    temp = None
    if args.adapter_dir is None:
        temp = tempfile.TemporaryDirectory(prefix="loraswap-swap-bench-")
        adapter_dir = Path(temp.name)
    else:
        adapter_dir = args.adapter_dir
    started = time.perf_counter()
    files: dict[str, Path] = {}
    wanted = [(args.rank, "a"), (args.rank, "b")] + [(rank, "a") for rank in args.mixed]
    for seed, (rank, tag) in enumerate(wanted, start=1):
        name = f"r{rank}-{tag}"
        if name not in files:
            files[name] = write_lora_file(
                pipe, layer_names, adapter_dir / name, rank=rank, patterns=patterns, seed=seed
            )
    stacks = None
    if args.stack_members:
        # Two stacks of `members` adapters on the headline's layers, each of rank rank // members.
        members, member_rank = args.stack_members, args.rank // args.stack_members
        stack_files = [
            write_lora_file(
                pipe, layer_names, adapter_dir / f"r{member_rank}-s{index}", rank=member_rank, patterns=patterns,
                seed=len(wanted) + 1 + index,
            )
            for index in range(2 * members)
        ]  # fmt: skip
        stacks = (tuple(stack_files[:members]), tuple(stack_files[members:]))
    kind_pairs = {}
    if args.kind_list and family.value == "sdxl":  # the kinds' layers are SDXL's (LoCon: the UNet's resnets)
        for index, kind in enumerate(args.kind_list):
            layers = kind_layers(denoiser, kind, layer_names)
            kind_pairs[kind] = tuple(
                write_kind_file(denoiser, layers, adapter_dir / f"{kind}-{tag}", kind=kind, rank=args.rank,
                                seed=100 + 2 * index + offset)
                for offset, tag in enumerate("ab")
            )  # fmt: skip
    write_s = time.perf_counter() - started
    headline = (files[f"r{args.rank}-a"], files[f"r{args.rank}-b"])
    mixed = (files[f"r{args.mixed[0]}-a"], files[f"r{args.mixed[1]}-a"]) if args.mixed else None

    bench = SwapBench(pipe, traits, layer_names, max_rank, args.repeats)
    diffusers_paths = tuple(p for p in args.path_list if p.startswith("diffusers_"))
    own_paths = tuple(p for p in args.path_list if not p.startswith("diffusers_"))
    pairs = [("headline", headline)] + ([("mixed_rank", mixed)] if mixed else [])
    measured: dict[str, tuple[dict, dict, dict]] = {label: ({}, {}, {}) for label, _ in pairs}
    for label, pair in pairs:
        log(f"{label}: diffusers' paths")
        for part, values in zip(measured[label], run_pair(bench, pair, diffusers_paths), strict=True):
            part.update(values)
    diffusers_kinds = None
    if kind_pairs:
        log("kinds: what diffusers reads")
        diffusers_kinds = bench.diffusers_kinds(kind_pairs)
    fuse = any(path in FUSE_PATHS for path in own_paths) or args.profile_fuse or bool(kind_pairs)
    install_s, pristine_s = bench.install_slot(fuse)
    freeze_start_up_objects()  # as `loraswap serve` does once it serves: no collection pauses over the model
    log(f"loraswap slot installed in {install_s:.2f} s" + (f", pristine copies in {pristine_s:.2f} s" if fuse else ""))
    for label, pair in pairs:
        log(f"{label}: loraswap's paths and the floors")
        for part, values in zip(measured[label], run_pair(bench, pair, own_paths), strict=True):
            part.update(values)
    stack_measured = None
    if stacks:
        log("stack: loraswap's stack path and its floor")
        stack_measured = run_pair(bench, stacks, STACK_PATHS)

    kinds_measured = None
    if kind_pairs:
        log(f"kinds: fused {', '.join(kind_pairs)} beside the headline LoRA, interleaved")
        kinds_measured = bench.fused_kinds(headline, kind_pairs) | {"rank": args.rank, "diffusers": diffusers_kinds}

    fuse_profile = None
    if args.profile_fuse:
        log("fused swap under torch.profiler")
        fuse_profile = bench.profile_fuse(headline)

    check = None
    if args.compile_backend != "none":
        # The smallest images the full-size models take: cheap runs with every layer in the graph.
        size = args.check_size or (16 if family.value == "flux" else 32)
        log(f"recompilation check: {args.compile_backend} backend, {size} px")
        check = bench.count_recompilations(
            [*headline, *(mixed or ()), *(stacks or ())], args.compile_backend, size,
            fused=[*headline, *(mixed or ())] if fuse else [],
        )  # fmt: skip
        log(f"recompilation check: {check['recompilations']} recompilations in {check['elapsed_s']:.1f} s")

    headline_paths, headline_first, _ = measured["headline"]
    result: dict[str, object] = {
        "benchmark": "swap",
        "model": args.model,
        "layers": _depth(args.model, args.layers),
        "dtype": args.dtype,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "rank": args.rank,
        "max_rank": max_rank,
        "target_modules": list(patterns),
        "slot_layers": len(layer_names),
        "adapter_bytes": _file_tensor_bytes(headline[0]),
        "adapter_file_bytes": headline[0].stat().st_size,
        # What a fused swap of the headline adapter reads (W0) and writes: the base weights of the layers it touches.
        "fused_weight_bytes": _weight_bytes(denoiser, layer_names),
        "pristine_bytes": bench.pristine_bytes,
        "repeats": args.repeats,
        "paths": headline_paths,
        "first_swap_s": headline_first,
        "ratios": ratios(headline_paths),
        # The same ratios of the measuring thread's CPU seconds: steadier when other processes share the cores.
        "ratios_cpu": ratios(headline_paths, "cpu_median_s"),
    }
    if mixed:
        mixed_paths, mixed_first, mixed_by_target = measured["mixed_rank"]
        directions = {}
        for path in mixed:
            key = f"to_{path.parent.name}"
            paths_one_way = {name: by_target[key] for name, by_target in mixed_by_target.items()}
            directions[key] = {
                "paths": paths_one_way, "ratios": ratios(paths_one_way),
                "ratios_cpu": ratios(paths_one_way, "cpu_median_s"),
            }  # fmt: skip
        # Swaps alternate between the two, so the overall median is one direction's; read "by_direction".
        result["mixed_rank"] = {
            "ranks": list(args.mixed),
            "adapter_bytes": [_file_tensor_bytes(path) for path in mixed],
            "paths": mixed_paths,
            "first_swap_s": mixed_first,
            "by_direction": directions,
        }
    if stacks:
        stack_paths, stack_first, _ = stack_measured
        stack_ratio = stack_paths["loraswap_stack"]["median_s"] / stack_paths["floor_copy_stack"]["median_s"]
        warm = headline_paths.get("loraswap_warm")
        result["stack"] = {
            "members": args.stack_members,
            "member_rank": args.rank // args.stack_members,
            "summed_rank": args.stack_members * (args.rank // args.stack_members),
            "adapter_bytes": sum(_file_tensor_bytes(path) for path in stacks[0]),
            "paths": stack_paths,
            "first_swap_s": stack_first,
            "ratios": {
                "loraswap_stack_over_floor_copy_stack": stack_ratio,
                # The headline adapter holds the same bytes when --rank divides by --stack-members.
                "loraswap_stack_over_loraswap_warm": (
                    stack_paths["loraswap_stack"]["median_s"] / warm["median_s"] if warm else None
                ),
            },
        }
    if kinds_measured is not None:
        result["kinds"] = kinds_measured
    if fuse_profile is not None:
        result["fuse_profile"] = fuse_profile
    result["recompilations"] = None if check is None else check["recompilations"]
    result["recompilation_check"] = check
    result["setup_s"] = {
        "build_model": build_s, "write_adapters": write_s, "loraswap_install": install_s, "pristine_copies": pristine_s,
    }  # fmt: skip
    result["machine"] = machine_info()
    result["elapsed_s"] = time.perf_counter() - run_started
    if temp is not None:
        temp.cleanup()
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(line, flush=True)
    return result


def _depth(model: str, layers: int | None) -> object:
    """Which depth was measured: Flux's (double, single) blocks; 'full' for SDXL."""
    if model == "random-flux":
        from loraswap.server.engine.models.random_full import flux_depth

        double, single = flux_depth(layers)
        return {"double_blocks": double, "single_blocks": single, "full_depth": layers is None}
    return "full" if model == "random-sdxl" else "tiny"


if __name__ == "__main__":
    main()
