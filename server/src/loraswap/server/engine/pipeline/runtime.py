"""The warm pipeline with its swap slot: choose how a stack is applied, make it resident, run one job.

`start_runtime` (startup.py) builds a DiffusionRuntime whole from the records its phases made
(records.py). Everything here runs on the engine's single worker thread; what other threads may read
is `snapshot`, a frozen record the worker replaces after start-up and after every job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from loraswap.server.engine.adapters.formats import CanonicalAdapter, SlotSpec, StackMember
from loraswap.server.engine.adapters.residency import AdapterResidency
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.errors import ErrorReason, InvalidRequestError
from loraswap.server.engine.fuse_policy import choose_fused, device_costs, merge_ms, unfused_ms
from loraswap.server.engine.pipeline.cpu_threads import FixedThreads
from loraswap.server.engine.pipeline.device_timeline import DeviceMark
from loraswap.server.engine.pipeline.image_encoding import DecodedImage
from loraswap.server.engine.pipeline.lora_work import work_at_guidance
from loraswap.server.engine.pipeline.records import (
    CompiledDenoiser,
    InstalledSlot,
    LoadedModel,
    StoredWeights,
    WarmedUp,
)
from loraswap.server.engine.pipeline.runner import PipelineRunner
from loraswap.server.engine.types import (
    FuseChoice,
    GeneratedImage,
    GenerationParams,
    RuntimeFacts,
    StepProgress,
    Timings,
)

if TYPE_CHECKING:
    from typing import Required, Unpack  # Python 3.11+; annotations only, so 3.10 runs without them


class GenerateOptions(TypedDict, total=False):
    """DiffusionRuntime.render's keywords, which generate passes on."""

    on_step: Required[Callable[[StepProgress], None]]
    is_cancelled: Required[Callable[[], bool]]
    timings: Timings | None
    warnings: tuple[str, ...]
    on_swap: Callable[[float, bool], None] | None
    fused: bool


@dataclass(frozen=True)
class RuntimeSnapshot:
    """What the runtime is now, for readers off the worker thread: its facts, and the resident adapters."""

    facts: RuntimeFacts
    resident: tuple[CanonicalAdapter, ...]  # every resident adapter, fused or not (the objects, not their names)


class DiffusionRuntime:
    """The warm pipeline with its swap slot, made by start_runtime. Call only on the worker thread."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        installed: InstalledSlot,
        weights: StoredWeights,
        compiled: CompiledDenoiser,
        warmed: WarmedUp,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.installed = installed
        self.weights = weights
        self.compiled = compiled
        self.warmed = warmed
        self.residency: AdapterResidency = installed.residency
        self._runner = PipelineRunner(loaded, compiled)
        self._slot_spec = self.residency.spec(
            loaded.traits.family, loaded.dtype, loaded.device, installed.model_layers,
            strict=config.strict_adapters, text_encoder_layers=config.text_encoder_layers,
        )  # fmt: skip
        self._static_facts = _static_facts(config, loaded, installed, weights, compiled, self._slot_spec)
        self.snapshot = self._take_snapshot()

    # -- facts --------------------------------------------------------------------------------------

    @property
    def request_rules(self):
        return self.loaded.request_rules

    @property
    def denoiser(self):
        return self.loaded.denoiser

    @property
    def recompilations(self) -> int:
        """Graphs compiled since warm-up finished (0 when not compiled)."""
        return self.compiled.graphs_compiled - self.warmed.graphs_at_ready

    def slot_spec(self) -> SlotSpec:
        """What adapters must fit to be made resident in this runtime."""
        return self._slot_spec

    def _take_snapshot(self) -> RuntimeSnapshot:
        resident = self.residency.resident_adapters
        facts = dataclasses.replace(
            self._static_facts,
            recompilations=self.recompilations,
            resident_adapter=resident[0].name if len(resident) == 1 else "",
            resident_adapters=tuple(sorted(adapter.name for adapter in resident)),
        )
        return RuntimeSnapshot(facts=facts, resident=resident)

    # -- how a stack is applied ---------------------------------------------------------------------

    def fuse_choice(self, stack: tuple[StackMember, ...], params: GenerationParams) -> bool:
        """Whether `params` runs with `stack` fused: the caller's pin (GenerateRequest.fuse, checked at admission)
        or the server's --fuse policy. Under auto a pure function of the request and the server's flags
        (fuse_policy.py's cost model), never of timings, the queue or what ran before: fused and unfused images
        differ in their last bits, so the same request gives the same bytes on every replica and after a restart.
        """
        if not stack or not self.config.fuses:
            return False
        if params.fuse is not None:
            return params.fuse is FuseChoice.FUSED
        bucket = self.unfused_bucket(stack)
        work = self.installed.lora_work
        if work is not None:
            work = work_at_guidance(self.loaded, work, params.guidance_scale)
        costs = device_costs(self.loaded.device.type)
        auto = self.config.fuse == "auto" and bucket is not None and work is not None
        return choose_fused(
            self.config.fuse,
            fusing=self.config.fuses,
            has_adapters=bool(stack),
            bucket=bucket,
            unfused_cost_ms=unfused_ms(costs, work, bucket, params.num_inference_steps, params.width * params.height)
            if auto else 0.0,
            merge_cost_ms=merge_ms(costs, self.residency.fused_weights.merge_work(stack)) if auto else 0.0,
        )  # fmt: skip

    def unfused_bucket(self, stack: tuple[StackMember, ...]) -> int | None:
        """The bucket `stack` computes at unfused; None when the slot cannot hold it, or when its bucket has no
        compiled graph (a compiled --fuse auto server warms up only the buckets its rule may choose). Pure: any
        thread may ask."""
        bucket = self.residency.unfused_bucket(stack)
        return bucket if bucket in self.warmed.unfused_buckets else None

    def needs_swap(self, stack: tuple[StackMember, ...], fused: bool) -> bool:
        """Whether running `stack` (fused or not) changes what is resident."""
        return self.residency.needs_swap(stack, fused)

    # -- requests -----------------------------------------------------------------------------------

    def generate(
        self, params: GenerationParams, stack: tuple[StackMember, ...], **options: Unpack[GenerateOptions]
    ) -> GeneratedImage:
        """`render`, then the image's file written on this thread: for callers that want the file at once (the
        benchmarks). The scheduler renders, and has the file written on its encoder's thread instead."""
        return self.render(params, stack, **options).encoded()

    def render(
        self,
        params: GenerationParams,
        stack: tuple[StackMember, ...],
        *,
        on_step: Callable[[StepProgress], None],
        is_cancelled: Callable[[], bool],
        timings: Timings | None = None,
        warnings: tuple[str, ...] = (),
        on_swap: Callable[[float, bool], None] | None = None,
        fused: bool = False,
    ) -> DecodedImage:
        """Make `stack` resident (fused: merged into the base weights; fuse_choice says when), run the pipeline
        streaming each step through on_step, and decode the image; `DecodedImage.encoded()` writes its file.

        `stack` holds the adapters and their strengths (() for the base model); `params` come from
        `request_rules.resolve` (which refuses an image whose file would take seconds to write). Raises
        GenerationCancelledError at the first step boundary after is_cancelled() turns true, before the VAE decode.
        """
        swap_marks = None  # (before, after) a swap that happened: it queues its work without waiting
        swap_ms = 0.0
        try:
            with self._runner.session():
                swaps = self.needs_swap(stack, fused)
                before = DeviceMark(self.loaded.device)
                fused = self._swap_in(stack, params, fused, merges=fused and swaps)
                if swaps:
                    swap_marks = (before, DeviceMark(self.loaded.device))
                run = self._runner.run(params, on_step=on_step, is_cancelled=is_cancelled, stack=stack)
        finally:
            self.snapshot = self._take_snapshot()
            if swap_marks is not None:
                # The swap's device time, known once the device has passed its end (the run waited for later marks).
                swap_ms = _elapsed_ms(*swap_marks)
                if on_swap is not None:
                    on_swap(swap_ms, fused)
        timings = dataclasses.replace(
            timings or Timings(), adapter_swap_ms=swap_ms, denoise_ms=run.denoise_ms, decode_ms=run.decode_ms,
            encode_prompt_ms=run.encode_prompt_ms,
        )  # fmt: skip
        image = GeneratedImage(
            data=b"", image_format=params.image_format, width=run.pixels.width, height=run.pixels.height,
            seed=params.seed, adapter=params.adapter, adapter_scale=params.adapter_scale, adapters=params.adapters,
            fused=self.residency.fused, timings=timings, warnings=warnings,
            changed_components=self._changed_components(stack),
        )  # fmt: skip
        return DecodedImage(pixels=run.pixels, image=image, decoded_at=run.decoded_at)

    def _changed_components(self, stack: tuple[StackMember, ...]) -> tuple[str, ...]:
        """The pipeline components the stack's adapters change (the denoiser's slot layers included), sorted."""
        components = set().union(*(adapter.changed_components for adapter, _ in stack))
        if any(adapter.layers for adapter, _ in stack):
            components.add(self._slot_spec.denoiser)
        return tuple(sorted(components))

    def _swap_in(self, stack: tuple[StackMember, ...], params: GenerationParams, fused: bool, *, merges: bool) -> bool:
        """Make `stack` resident, fused or not (`merges`: this swap merges); returns whether it is fused.

        Under auto, fusing is only the cheaper way: a stack whose merge would overflow the model's dtype but
        fits the slot runs unfused instead, as it would under never (every time: whether a merge overflows is a
        property of the stack and its strengths). A pinned fused path is refused instead.
        """
        try:
            self.residency.load_stack(stack, fused=fused)
            return fused
        except InvalidRequestError as refused:
            auto_may_unfuse = (
                self.config.fuse == "auto" and params.fuse is None and self.unfused_bucket(stack) is not None
            )
            if not (merges and auto_may_unfuse and refused.reason == ErrorReason.ADAPTER_OUT_OF_RANGE):
                raise
            self.residency.load_stack(stack, fused=False)
            return False


def _static_facts(
    config: EngineConfig,
    loaded: LoadedModel,
    installed: InstalledSlot,
    weights: StoredWeights,
    compiled: CompiledDenoiser,
    slot_spec: SlotSpec,
) -> RuntimeFacts:
    """The facts that stay as they are for the runtime's life (what is resident and the recompilations aside)."""
    rules = loaded.request_rules
    slot = installed.residency.slot
    return RuntimeFacts(
        family=loaded.traits.family,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        max_rank=slot.max_rank,
        target_layers=installed.target_layers,
        compiled=compiled.compiled,
        compile_mode=compiled.label,
        recompilations=0,
        resident_adapter="",
        size_multiple=rules.size_multiple,
        min_size=rules.min_size,
        max_size=rules.max_size,
        max_stack=rules.max_stack,
        default_width=rules.defaults.width,
        default_height=rules.defaults.height,
        default_num_inference_steps=rules.defaults.num_inference_steps,
        default_guidance_scale=rules.defaults.guidance_scale,
        rank_buckets=slot.rank_buckets,
        quantization=weights.quantization,
        denoiser_weight_bytes=weights.denoiser_weight_bytes,
        attention_backend=compiled.attention_backend,
        pinned_adapter_memory=slot_spec.pin_memory,
        device_adapter_bytes=installed.device_adapter_bytes,
        fuse=config.fuse,
        fuse_pristine_bytes=installed.pristine_bytes,
        torch_threads=loaded.threads.threads if isinstance(loaded.threads, FixedThreads) else 0,
    )


def _elapsed_ms(before: DeviceMark, after: DeviceMark) -> float:
    """Device milliseconds between two marks, waiting for the later one (passed already after a run)."""
    after.wait()
    return after.ms_since(before)
