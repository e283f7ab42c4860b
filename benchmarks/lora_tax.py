"""The LoRA tax: what one compiled denoiser forward costs with the swap slot in place, by resident adapter.

    python -m benchmarks.lora_tax                                         # random-sdxl (full UNet), 256², inductor
    python -m benchmarks.lora_tax --model random-flux --layers 1 --size 128 --repeats 5   # a few minutes on a CPU

One process builds the pipeline once and captures the denoiser's real inputs from one pipeline
call (its own text encoders, size and guidance). Three copies of the denoiser share every base
weight: `bare` (no LoRA), ours (the swap slot on the server's default target layers at
`--max-rank`, with `--rank-buckets`), and diffusers' (`enable_lora_hotswap(target_rank=max rank)`
then a rank-8 adapter loaded: its hotswap-prepared placeholder, which computes at the full rank
whatever it holds). Each copy is compiled (`--backend`, inductor by default) through a
graph-counting backend. Variants of our slot: nothing resident (`slot_base`: the LoRA branch
skipped), rank-8, -32 and -64 adapters (each computing at its rank bucket), and, as the slot was
before buckets, nothing resident and rank 8 computed at the full max rank (`*_full_width`).
Fused (`fused_r8`, `fused_r32`, `fused_r64`): the same adapters merged into the base weights of
the slot layers (adapters/residency/fused.py, from pristine copies kept apart as --fuse does), the slot's
copy then running the base model's graph; the copies share their base weights, so every other
variant first puts W0 back (untimed). Every variant runs once untimed (its compile: `compile_s`), then `--repeats` rounds time one
forward of each, variants interleaved and the order rotated every round so that machine noise
hits them alike. With `--quantize int8wo` (default when the engine has quantization) the whole
set is measured again with the base linear weights quantized by torchao (without the fused
variants: the server never fuses quantized weights). The last line printed
is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.swap import build_pipeline, in_process_prelude, log, machine_info, random_lora_factors

# torch is imported where it is used, so that `--help` starts without the seconds torch takes to import.
if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "random-sdxl"
DEFAULT_SIZE = 256
DEFAULT_MAX_RANK = 64
DEFAULT_REPEATS = 7
ADAPTER_RANKS = (8, 32, 64)
DIFFUSERS_ADAPTER_RANK = 8

# name -> (how it runs, resident rank or None, compute at the full max rank like the slot before buckets);
# "fused" runs the slot's copy with the adapter merged into the base weights (the base model's graph).
VARIANTS = {
    "bare": ("bare", None, False),
    "slot_base": ("slot", None, False),
    "slot_base_full_width": ("slot", None, True),
    "slot_r8": ("slot", 8, False),
    "slot_r8_full_width": ("slot", 8, True),
    "slot_r32": ("slot", 32, False),
    "slot_r64": ("slot", 64, False),
    "fused_r8": ("fused", 8, False),
    "fused_r32": ("fused", 32, False),
    "fused_r64": ("fused", 64, False),
    "diffusers_hotswap": ("diffusers", DIFFUSERS_ADAPTER_RANK, False),
}
FUSED_VARIANTS = tuple(name for name, (how, _, _) in VARIANTS.items() if how == "fused")


def _random_adapter(denoiser, layer_names: list[str], rank: int, seed: int):
    """A canonical adapter of `rank` on every slot layer, in the denoiser's dtype."""
    from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer

    layers = {name: CanonicalLayer(a=a, b=b) for name, a, b in random_lora_factors(denoiser, layer_names, rank, seed)}
    return CanonicalAdapter(name=f"r{rank}", source="bench", layers=layers, warnings=(), load_ms=0.0)


def _captured_inputs(pipe, traits, size: int) -> tuple[tuple, dict]:
    """The denoiser's positional and keyword inputs of the first step of a real pipeline call at `size`."""
    import torch

    from loraswap.server.engine.models import generation_defaults

    captured = {}

    def hook(module, args, kwargs):
        if not captured:
            captured["args"] = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            captured["kwargs"] = {
                k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in kwargs.items()
            }

    denoiser = traits.denoiser(pipe)
    handle = denoiser.register_forward_pre_hook(hook, with_kwargs=True)
    defaults = generation_defaults("random", pipe)
    kwargs = dict(prompt="a lighthouse at dusk", num_inference_steps=1, width=size, height=size, output_type="latent")
    kwargs.update(traits.pipeline_kwargs("", defaults.guidance_scale, defaults))
    if defaults.max_sequence_length is not None:
        kwargs["max_sequence_length"] = defaults.max_sequence_length
    try:
        with torch.inference_mode():
            pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(0))
    finally:
        handle.remove()
    return captured["args"], captured["kwargs"]


def _shared_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the module that shares every parameter and buffer with it (no weight bytes copied)."""
    memo = {id(tensor): tensor for tensor in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _diffusers_state_dict(denoiser, layer_names: list[str], rank: int) -> dict[str, torch.Tensor]:
    adapter = _random_adapter(denoiser, layer_names, rank, seed=99)
    state = {}
    for name, layer in adapter.layers.items():
        state[f"{name}.lora_A.weight"] = layer.a.clone()
        state[f"{name}.lora_B.weight"] = layer.b.clone()
    return state


def measure(pipe, traits, args, quantization: str) -> dict:
    """Build the three copies, compile each, then time every variant interleaved; one result dict."""
    import torch

    from loraswap.server.engine.adapters.residency import AdapterResidency, FusedWeights, HotswapSlot
    from loraswap.server.engine.pipeline.compile import CountingBackend
    from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
    from loraswap.server.engine.rank_buckets import resolve_rank_buckets

    base = traits.denoiser(pipe)
    device = torch.device("cpu")
    layer_names = resolve_target_layers(base, tuple(traits.default_target_modules))
    buckets = resolve_rank_buckets(args.bucket_tuple, args.max_rank)
    call_args, call_kwargs = _captured_inputs(pipe, traits, args.size)

    copies = {"bare": _shared_copy(base), "slot": _shared_copy(base), "diffusers": _shared_copy(base)}
    installed = HotswapSlot.install(copies["slot"], layer_names, args.max_rank, base.dtype, device, buckets)
    copies["diffusers"].enable_lora_hotswap(target_rank=args.max_rank)
    copies["diffusers"].load_lora_adapter(
        _diffusers_state_dict(base, layer_names, DIFFUSERS_ADAPTER_RANK), prefix=None, adapter_name="bench"
    )
    copies["diffusers"].requires_grad_(False)
    if quantization != "none":
        from loraswap.server.engine.pipeline.quantization import quantize_denoiser

        for module in copies.values():
            quantize_denoiser(module, quantization)
    # What --fuse auto|always keeps at start-up (weights not quantized): the slot layers' W0, apart, to merge from.
    fused = FusedWeights.over_layers("denoiser", installed.base_layers()) if quantization == "none" else None
    slot = AdapterResidency(installed, fused)
    adapters = {rank: _random_adapter(base, layer_names, rank, seed=rank) for rank in ADAPTER_RANKS}
    counters = {}
    for name, module in copies.items():
        if args.backend != "none":
            counters[name] = CountingBackend(args.backend)
            module.compile(backend=counters[name])
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(installed.graph_buckets))

    computes_at: dict[str, int] = {}
    merges_ms: dict[str, list[float]] = {variant: [] for variant in FUSED_VARIANTS}

    def run(variant: str) -> float:
        which, rank, full_width = VARIANTS[variant]
        with torch.inference_mode():
            if which == "slot":
                slot.load_stack(((adapters[rank], 1.0),) if rank else ())  # puts W0 back first if a merge is resident
            elif which == "fused":
                members = ((adapters[rank], 1.0),)
                merges = not (slot.fused and slot.holds(members))
                merge_ms = slot.load_stack(members, fused=True)
                if merges:
                    merges_ms[variant].append(merge_ms)
            elif slot.fused:
                slot.load_stack(())  # the copies share base weights: bare and diffusers' run on W0
        module = copies["slot" if which == "fused" else which]
        with torch.inference_mode(), slot.computing_at(args.max_rank) if full_width else contextlib.nullcontext():
            if which in ("slot", "fused"):
                computes_at[variant] = slot.bucket
            started = time.perf_counter()
            module(*call_args, **call_kwargs)
            return time.perf_counter() - started

    variants = [name for name in VARIANTS if quantization == "none" or name not in FUSED_VARIANTS]
    compile_s = {}
    for variant in variants:
        log(f"[{quantization}] first call (compile) of {variant}")
        compile_s[variant] = run(variant)
        run(variant)  # a second untimed call: caches, allocator
    graphs_at_ready = {name: counter.graphs_compiled for name, counter in counters.items()}
    samples: dict[str, list[float]] = {variant: [] for variant in variants}
    for round_index in range(args.repeats):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            samples[variant].append(run(variant))
        log(f"[{quantization}] round {round_index + 1}/{args.repeats}")
    bare_ms = statistics.median(samples["bare"]) * 1000.0
    results = {}
    for variant in variants:
        median_ms = statistics.median(samples[variant]) * 1000.0
        results[variant] = {
            "median_ms": round(median_ms, 2),
            "min_ms": round(min(samples[variant]) * 1000.0, 2),
            "max_ms": round(max(samples[variant]) * 1000.0, 2),
            "over_bare_pct": round((median_ms / bare_ms - 1.0) * 100.0, 2),
            "first_call_s": round(compile_s[variant], 2),
            **({"computes_at_rank": computes_at[variant]} if variant in computes_at else {}),
        }
        if variant in FUSED_VARIANTS:
            # What the merge costs against what it saves per forward over the same adapter unfused.
            merge_ms = statistics.median(merges_ms[variant])
            unfused_ms = results[f"slot_r{VARIANTS[variant][1]}"]["median_ms"]
            saving_ms = unfused_ms - median_ms
            results[variant].update(
                merge_ms=round(merge_ms, 2),
                merges=len(merges_ms[variant]),
                over_slot_base_pct=round((median_ms / results["slot_base"]["median_ms"] - 1.0) * 100.0, 2),
                saving_ms_per_forward=round(saving_ms, 2),
                merge_pays_after_forwards=round(merge_ms / saving_ms, 2) if saving_ms > 0 else None,
            )
    return {
        "quantization": quantization,
        "slot_layers": len(layer_names),
        "rank_buckets": list(buckets),
        "pristine_bytes": slot.fused_weights.pristine.nbytes if slot.fused_weights is not None else 0,
        "variants": results,
        "graphs": {name: counter.graphs_compiled for name, counter in counters.items()},
        "recompilations": sum(counters[name].graphs_compiled - graphs_at_ready[name] for name in counters),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_tax", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="random-sdxl, random-flux, tiny-sdxl or tiny-flux")
    parser.add_argument("--layers", type=int, default=None, help="random-flux only: double-stream blocks to keep")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="image width and height")
    parser.add_argument("--max-rank", type=int, default=DEFAULT_MAX_RANK, help="the slot's (and hotswap's) rank")
    parser.add_argument("--rank-buckets", default="", help="the slot's buckets, e.g. 16,32,64 (default: the server's)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed rounds over every variant")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend; none: uncompiled")
    parser.add_argument("--dtype", default="bfloat16", help="weights' dtype")
    parser.add_argument(
        "--quantize", default=None, help="comma-separated: none,int8wo (default: both when the engine quantizes)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    from loraswap.server.engine.rank_buckets import parse_rank_buckets

    args.bucket_tuple = parse_rank_buckets(args.rank_buckets)
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the JSON result as the last line of stdout, and return it."""
    args = parse_args(argv)
    in_process_prelude(args.threads)
    import torch

    from loraswap.server.engine.config import EngineConfig
    from loraswap.server.engine.families import family_of

    engine_quantizes = "quantize" in {field.name for field in dataclasses.fields(EngineConfig)}
    if args.quantize is None:
        quantizations = ["none", "int8wo"] if engine_quantizes else ["none"]
    else:
        quantizations = [q.strip() for q in args.quantize.split(",") if q.strip()]
    notes = []
    if not engine_quantizes:
        notes.append("int8wo skipped: this engine has no --quantize")
        quantizations = [q for q in quantizations if q == "none"]

    started = time.perf_counter()
    pipe = build_pipeline(args.model, getattr(torch, args.dtype), args.layers)
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.requires_grad_(False)
    traits = family_of(pipe)
    log(f"{args.model} built in {time.perf_counter() - started:.1f} s")
    runs = []
    for quantization in quantizations:
        runs.append(measure(pipe, traits, args, quantization))
        log(f"[{quantization}] {json.dumps(runs[-1])}")  # each run's figures as soon as they exist
    result = {
        "benchmark": "lora_tax",
        "model": args.model,
        "layers": args.layers if args.layers is not None else "all",
        "size": args.size,
        "dtype": args.dtype,
        "backend": args.backend,
        "max_rank": args.max_rank,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "machine": machine_info(),
        "runs": runs,
        "notes": notes,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2))
    print(text)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
