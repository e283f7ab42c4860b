"""How each variant of the GPU check serves a request: the engine's own start-up phases and PipelineRunner.

- `bare` and `fp8_bare`: no adapter slot. The engine's load, quantize and compile phases (startup.py's functions,
  the slot's left out), and its PipelineRunner, the image written as
  DiffusionRuntime.generate writes it: the same step callback and image encoding as a served request, with nothing
  resident to swap.
- `fused`, `unfused` and `fp8_fused`: the server's DiffusionRuntime from start_runtime, `--fuse always` (a new
  adapter merged into the base weights from their pristine copies before every request: the steps run the base
  model's graph) or `--fuse never` (copied into the swap slot: the steps run its LoRA branch).
"A new adapter" is a new adapter object for every request (two files' contents, written once and read by the
server's loader, taken in turn): the runtime has never made it resident, so it swaps or merges it whole.

Both paths encode prompts at `--max-sequence-length` T5 tokens: the engine takes the length from the model's
defaults only (random-flux: 32), so the check replaces them in the load phase's record (FLUX.1-dev's is 512).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = "a photo of a red fox in the snow, golden hour, 35 mm"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of serving that the check measures; `fuse` None: no adapter slot at all (bare)."""

    name: str
    quantize: str
    fuse: str | None

    @property
    def slot(self) -> bool:
        return self.fuse is not None


VARIANTS = {
    variant.name: variant
    for variant in (
        Variant("bare", "none", None),
        Variant("fused", "none", "always"),
        Variant("unfused", "none", "never"),
        Variant("fp8_bare", "fp8", None),
        Variant("fp8_fused", "fp8", "always"),
    )
}


@dataclasses.dataclass(frozen=True)
class Served:
    """One served request as the check sees it: its wall clock and the runtime's Timings."""

    seconds: float
    timings: object  # engine.types.Timings

    def phases(self) -> dict[str, float]:
        """Each phase on its own: denoise without the prompt encoding, decode without the image encoding (the
        runtime's denoise_ms holds encode_prompt_ms, its decode_ms encode_image_ms)."""
        timings = self.timings
        return {
            "swap": timings.adapter_swap_ms,
            "encode_prompt": timings.encode_prompt_ms,
            "denoise": timings.denoise_ms - timings.encode_prompt_ms,
            "decode": timings.decode_ms - timings.encode_image_ms,
            "encode_image": timings.encode_image_ms,
        }


def median_phases(served: list[Served]) -> dict[str, float]:
    """The median of each phase over the requests, in milliseconds."""
    phases = [request.phases() for request in served]
    return {name: round(statistics.median(p[name] for p in phases), 2) for name in phases[0]}


def engine_config(args: argparse.Namespace, variant: Variant):
    """The EngineConfig of a variant: the check's model, size of slot and compile, the variant's storage and fuse."""
    from loraswap.server.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        layers=args.layers,
        device=args.device,
        dtype=args.dtype,
        max_rank=args.rank,
        rank_buckets=(args.rank,),  # the adapters are rank-`rank`: one bucket, one set of graphs
        compile=args.compile,
        compile_mode=args.compile_mode,
        quantize=variant.quantize,
        fuse=variant.fuse or "never",
        torch_threads=None,
        warmup=args.warm_up,
    )


def _with_sequence_length(loaded, length: int):
    """The load phase's record with prompts encoded at `length` T5 tokens (Flux; SDXL has no such setting)."""
    if loaded.defaults.max_sequence_length is None:
        return loaded, None
    defaults = dataclasses.replace(loaded.defaults, max_sequence_length=length)
    return dataclasses.replace(loaded, defaults=defaults), length


def _request(args: argparse.Namespace, index: int, steps: int | None):
    from loraswap.server.engine.types import GenerationRequest, ImageFormat

    return GenerationRequest(
        prompt=PROMPT, width=args.size, height=args.size, num_inference_steps=steps or args.steps, seed=index,
        image_format=ImageFormat(args.image_format),
    )  # fmt: skip


# -- bare: no slot ------------------------------------------------------------------------------------------------


class BarePath:
    """The pipeline without any slot, served by the engine's PipelineRunner."""

    fused = False
    residency = None  # nothing is ever made resident

    def __init__(self, args: argparse.Namespace, loaded, compiled) -> None:
        from loraswap.server.engine.pipeline.runner import PipelineRunner

        self.loaded, self.sequence_length = _with_sequence_length(loaded, args.max_sequence_length)
        self.compiled = compiled
        self.pipe = loaded.pipe
        self.runner = PipelineRunner(self.loaded, compiled)
        self.args = args

    @classmethod
    def start(cls, args: argparse.Namespace, variant: Variant) -> BarePath:
        """The engine's start-up phases less the slot (and the warm-up), each logged as start_runtime logs its own."""
        from loraswap.server.engine.pipeline.preflight import preflight
        from loraswap.server.engine.pipeline.startup import compile_denoiser, load, quantize

        config = engine_config(args, variant)
        preflight(config)
        with _startup_phase("load"):
            loaded = load(config)
        if config.quantize != "none":
            with _startup_phase("quantize"):
                quantize(config, loaded)
        with _startup_phase("compile"):
            compiled = compile_denoiser(config, loaded, _no_slot())
        return cls(args, loaded, compiled)

    @property
    def recompilations(self) -> int:
        return self.compiled.graphs_compiled

    def request(self, index: int, steps: int | None = None) -> Served:
        """As DiffusionRuntime.generate serves one: resolved (which refuses a file that would take seconds to write),
        run, then the file written on this thread (render's reply, then DecodedImage.encoded), nothing resident."""
        from loraswap.server.engine.pipeline.image_encoding import DecodedImage
        from loraswap.server.engine.types import GeneratedImage, Timings

        params = self.loaded.request_rules.resolve(_request(self.args, index, steps))
        started = time.perf_counter()
        with self.runner.session():
            run = self.runner.run(params, on_step=lambda progress: None, is_cancelled=lambda: False)
        timings = Timings(denoise_ms=run.denoise_ms, decode_ms=run.decode_ms, encode_prompt_ms=run.encode_prompt_ms)
        reply = GeneratedImage(
            data=b"", image_format=params.image_format, width=run.pixels.width, height=run.pixels.height,
            seed=params.seed, adapter="", adapter_scale=1.0, timings=timings,
        )  # fmt: skip
        image = DecodedImage(pixels=run.pixels, image=reply, decoded_at=run.decoded_at).encoded()
        return Served(time.perf_counter() - started, image.timings)

    def floor(self, device) -> dict:
        return {"swap_floor_ms": None}

    def facts(self) -> dict:
        from loraswap.server.engine.pipeline.quantization import weight_bytes

        return {
            "max_sequence_length": self.sequence_length,
            "denoiser_weight_gib": round(weight_bytes(self.loaded.denoiser) / 1024**3, 2),
            "attention_backend": self.compiled.attention_backend,
            "compiled": self.compiled.label,
        }


@contextlib.contextmanager
def _startup_phase(name: str):
    """A start-up phase of the bare path, logged as start_runtime logs its own ("start-up <phase>: ...")."""
    logger = logging.getLogger("loraswap.server.engine.pipeline.startup")
    logger.info("start-up %s begins", name, extra={"phase": name, "event": "begins"})
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    logger.info(
        "start-up %s: %.2f s, no slot (gpu_check bare)", name, seconds,
        extra={"phase": name, "event": "done", "seconds": round(seconds, 3)},
    )  # fmt: skip


def _no_slot():
    """What compile_denoiser reads of the slot phase's record (the graph buckets, for its recompile budget), for a
    pipeline with no slot: the base model's graph alone. A stand-in rather than a copy of compile_denoiser, so that
    bare gets the very attention choice (measured on Hopper) and compile the slot variants get."""
    from types import SimpleNamespace

    return SimpleNamespace(residency=SimpleNamespace(slot=SimpleNamespace(graph_buckets=(0,))))


# -- fused and unfused: the server's runtime -----------------------------------------------------------------------


class SlotPath:
    """The server's DiffusionRuntime, a new adapter object before every request."""

    def __init__(self, args: argparse.Namespace, variant: Variant, runtime, adapters: list) -> None:
        from loraswap.server.engine.pipeline.runtime import DiffusionRuntime

        loaded, self.sequence_length = _with_sequence_length(runtime.loaded, args.max_sequence_length)
        records = (runtime.installed, runtime.weights, runtime.compiled, runtime.warmed)
        self.runtime = DiffusionRuntime(runtime.config, loaded, *records)
        self.residency = self.runtime.residency  # what makes adapters resident: the swaps happen in its load_stack
        self.pipe = loaded.pipe
        self.fused = variant.fuse == "always"
        self.adapters = adapters
        self.args = args

    @staticmethod
    def start(args: argparse.Namespace, variant: Variant):
        """start_runtime with the variant's settings (it logs its own phases)."""
        from loraswap.server.engine.pipeline.startup import start_runtime

        return start_runtime(engine_config(args, variant))

    @property
    def recompilations(self) -> int:
        return self.runtime.recompilations

    def adapter(self, index: int):
        """A new adapter object for request `index` (the two files' contents in turn)."""
        base = self.adapters[index % 2]
        return dataclasses.replace(base, name=f"{base.name}-request-{index}", swap_cache={})

    def request(self, index: int, steps: int | None = None) -> Served:
        runtime = self.runtime
        params = runtime.request_rules.resolve(_request(self.args, index, steps))
        stack = ((self.adapter(index), 1.0),)
        started = time.perf_counter()
        image = runtime.generate(
            params, stack, on_step=lambda progress: None, is_cancelled=lambda: False, fused=self.fused
        )
        seconds = time.perf_counter() - started
        if image.fused != self.fused:
            raise RuntimeError(f"asked for fused={self.fused}, the runtime made the image with fused={image.fused}")
        return Served(seconds, image.timings)

    def floor(self, device) -> dict:
        """The copies a swap cannot beat: the factors to the device (the slot's swap), and, fused, each touched
        layer's W0 read and its weight written once (the merge's)."""
        adapter = self.adapters[0]
        factors = _factor_copy_floor(adapter, device)
        if not self.fused:
            return {"swap_floor_ms": factors["ms"], "swap_floor_bytes": factors["bytes"]}
        merge = _merge_floor(self.runtime, adapter, device)
        return {
            "swap_floor_ms": merge["ms"],
            "swap_floor_bytes": merge["bytes"],
            "factors_to_device_ms": factors["ms"],
            "factors_bytes": factors["bytes"],
        }

    def facts(self) -> dict:
        runtime = self.runtime
        return {
            "max_sequence_length": self.sequence_length,
            "denoiser_weight_gib": round(runtime.snapshot.facts.denoiser_weight_bytes / 1024**3, 2),
            "slot_layers": len(runtime.installed.target_layers),
            "fused": self.fused,
            "fuse_pristine_gib": round(runtime.installed.pristine_bytes / 1024**3, 2),
            "adapter_bytes": self.adapters[0].nbytes,
            "attention_backend": runtime.compiled.attention_backend,
            "compiled": runtime.compiled.label,
        }


def two_adapters(runtime, rank: int, device: str) -> list:
    """Two rank-`rank` LoRAs over every slot layer, in diffusers' file layout with small random factors, read by
    the server's loader (pinned on CUDA, as cached adapters are)."""
    import torch
    from safetensors.torch import save_file

    from loraswap.server.engine.adapters.formats import load_canonical
    from loraswap.server.engine.adapters.sources import AdapterFile

    adapters = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in (1, 2):
            # Drawn on the device: FLUX's 500 MB of normal values take seconds on a CPU.
            generator = torch.Generator(device).manual_seed(seed)
            tensors = {}
            for name in runtime.installed.target_layers:
                layer = runtime.denoiser.get_submodule(name).base_layer
                for factor, shape in (("lora_A", (rank, layer.in_features)), ("lora_B", (layer.out_features, rank))):
                    values = torch.randn(shape, generator=generator, device=device) * 0.01
                    tensors[f"transformer.{name}.{factor}.weight"] = values.to("cpu", torch.bfloat16)
            path = Path(folder) / f"adapter-{seed}.safetensors"
            save_file(tensors, path)
            del tensors
            adapter_file = AdapterFile(name=path.stem, path=path, source=path.name)
            adapters.append(load_canonical(adapter_file, runtime.slot_spec()))
    return adapters


# -- the floors: plain copies of the bytes a swap moves ---------------------------------------------------------------


def _device_ms(device, work, repeats: int = 5) -> float:
    """The median time of `work` (after one untimed run): CUDA events on a GPU, so the host waits for nothing between
    the copies; the wall clock elsewhere."""
    import torch

    cuda = torch.device(device).type == "cuda"
    work()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            work()
            times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def _stored_dtype(weight):
    """The dtype a weight's values are stored in: a torchao float8 tensor's data (qdata), else the tensor's own."""
    data = getattr(weight, "qdata", None)
    return data.dtype if data is not None else weight.dtype


def _merge_floor(runtime, adapter, device) -> dict:
    """Each layer the adapter touches: its pristine copy read and copied into a scratch of the weight's stored dtype
    (bf16, or fp8 for --quantize fp8): the bytes a merge from W0 must read and write."""
    import torch

    pristine = runtime.residency.fused_weights.pristine
    component = runtime.loaded.traits.denoiser_attribute
    scratch: dict = {}
    pairs = []
    moved = 0
    for name in adapter.layers:
        source = pristine.weights[(component, name)]
        dtype = _stored_dtype(runtime.denoiser.get_submodule(name).base_layer.weight)
        key = (tuple(source.shape), dtype)
        if key not in scratch:
            scratch[key] = torch.empty(source.shape, dtype=dtype, device=source.device)
        pairs.append((scratch[key], source))
        moved += source.numel() * (source.element_size() + scratch[key].element_size())

    def copy() -> None:
        for target, source in pairs:
            target.copy_(source)

    with torch.inference_mode():
        return {"ms": round(_device_ms(device, copy), 3), "bytes": moved}


def _factor_copy_floor(adapter, device) -> dict:
    """The adapter's factors copied from where the server keeps them (pinned host memory on CUDA) to the device."""
    import torch

    pairs = []
    moved = 0
    for layer in adapter.layers.values():
        for source in (layer.a, layer.b):
            pairs.append((torch.empty(source.shape, dtype=source.dtype, device=device), source))
            moved += 2 * source.numel() * source.element_size()

    def copy() -> None:
        for target, source in pairs:
            target.copy_(source, non_blocking=True)

    with torch.inference_mode():
        return {"ms": round(_device_ms(device, copy), 3), "bytes": moved}
