"""One worker thread owns the pipeline; requests wait in a bounded queue and run one at a time.

Batching different adapters was measured as a bad trade for diffusion, so the
worker runs one job at a time. Events for a job go back to whoever submitted it
through the job's `emit` callable (the engine makes it thread-safe with
`loop.call_soon_threadsafe`). Cancellation is a flag the pipeline's step
callback checks; a stop during start-up is one too (StartupStop).

The worker stops at the decoded image: an ImageEncoder writes its file on a thread
of its own and emits it, while the worker runs the next job's steps. A job's
progress events are all emitted before its image is handed over, so they arrive
first.

The worker is a daemon thread, so it must have left torch before the interpreter
finalizes: Python 3.11 ends a daemon thread that wants the GIL back then with
pthread_exit, whose unwinding through torch's noexcept C++ frames calls
std::terminate (SIGABRT). `worker_alive` says whether it has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from loraswap.server.engine.adapters.formats import CanonicalAdapter, StackMember
from loraswap.server.engine.adapters.residency import stack_order
from loraswap.server.engine.errors import (
    EngineError,
    GenerationFailedError,
    NotServingError,
    QueueFullError,
    StartupError,
    StartupStopped,
)
from loraswap.server.engine.observer import NO_OBSERVER, EngineObserver, SwapMode, SwapPath
from loraswap.server.engine.pipeline.image_encoding import ImageEncoder
from loraswap.server.engine.pipeline.runtime import DiffusionRuntime
from loraswap.server.engine.pipeline.startup_stop import StartupStop
from loraswap.server.engine.setting_spec import SettingsError
from loraswap.server.engine.types import GeneratedImage, GenerationParams, Queued, Timings

log = logging.getLogger(__name__)


@dataclass(eq=False)
class GenerationJob:
    """One accepted request on its way through the queue and the worker."""

    params: GenerationParams
    stack: tuple[StackMember, ...]  # the adapters to apply and their strengths, in stack_order; () for the base
    emit: Callable[[object], None]  # receives Queued / StepProgress / GeneratedImage / EngineError
    adapter_load_ms: float = 0.0
    warnings: tuple[str, ...] = ()
    enqueued_at: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    position: int = 0
    times_bypassed: int = 0
    abort_error: EngineError | None = None  # sent instead of CANCELLED when the server aborts the job

    def __post_init__(self) -> None:
        self.stack = stack_order(self.stack)

    def uses(self, resident: tuple[CanonicalAdapter, ...]) -> bool:
        """True when the job needs exactly the resident adapters (strengths aside): it runs without a swap."""
        return len(self.stack) == len(resident) and all(
            adapter is other for (adapter, _), other in zip(self.stack, resident)
        )


class GenerationScheduler:
    """Bounded queue in front of the single worker thread that builds and runs the runtime.

    Order: oldest first, except that a waiting job using the adapter already
    resident in the swap slot may go ahead (no swap needed), as long as no job
    is passed over more than `max_bypass` times (0: plain FIFO). A stack is one
    resident state: a job for the same members, in any order, may go ahead too.
    """

    def __init__(
        self,
        runtime_factory: Callable[[StartupStop], DiffusionRuntime],
        max_queue: int,
        max_bypass: int = 4,
        observer: EngineObserver = NO_OBSERVER,
    ) -> None:
        self.max_queue = max_queue
        self._observer = observer
        self.max_bypass = max_bypass
        self.swaps = 0  # adapter changes the worker made (for benchmarks and tests)
        self.ready: Future[DiffusionRuntime] = Future()
        self.startup_stop = StartupStop()
        self._runtime_factory = runtime_factory
        self._cond = threading.Condition()
        self._waiting: list[GenerationJob] = []
        self._running: GenerationJob | None = None
        self._accepting = True
        self._stopped = False
        self._encoder = ImageEncoder()
        self._thread = threading.Thread(target=self._work, name="loraswap-worker", daemon=True)

    def start(self) -> None:
        """Start the worker; `ready` resolves once the runtime is loaded and warm (StartupStopped after a stop)."""
        # Only the worker resolves `ready`: an awaiting task that is cancelled must not cancel it under the worker.
        self.ready.set_running_or_notify_cancel()
        self._thread.start()

    def submit(self, job: GenerationJob) -> None:
        """Queue a job, or raise QueueFullError / NotServingError without disturbing anything queued."""
        with self._cond:
            if not self._accepting or not self.ready.done() or self.ready.exception() is not None:
                raise NotServingError("the server is not serving right now (starting up or shutting down); retry")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (--max-queue {self.max_queue}); retry shortly",
                    retry_after_s=1.0,
                )
            self._waiting.append(job)
            self._publish_positions()
            self._cond.notify()

    def cancel(self, job: GenerationJob) -> None:
        """Withdraw a waiting job at once, or stop a running one at its next step boundary."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self._publish_positions()

    @property
    def queue_length(self) -> int:
        with self._cond:
            return len(self._waiting)

    def stop_accepting(self) -> None:
        """New submissions fail with NotServingError; queued and running jobs go on."""
        with self._cond:
            self._accepting = False

    def is_idle(self) -> bool:
        """Nothing waits, nothing runs, and no image is being written."""
        with self._cond:
            return not self._waiting and self._running is None and self._encoder.idle

    def abort_all(self, error: EngineError) -> None:
        """Fail every waiting job with `error` now, and the running one at its next step boundary."""
        with self._cond:
            waiting, self._waiting = self._waiting, []
            running = self._running
            if running is not None:
                running.abort_error = error
                running.cancelled.set()
        for job in waiting:
            job.cancelled.set()
            job.emit(error)

    def stop(self) -> None:
        """Let the worker finish what is queued, then end; a start-up under way stops at its next stopping point.

        Returns at once: `worker_alive` says when the worker has ended.
        """
        self.startup_stop.request()
        with self._cond:
            self._accepting = False
            self._stopped = True
            self._cond.notify_all()

    @property
    def worker_alive(self) -> bool:
        """The worker thread is running (in the start-up, a job, waiting for one, or for the last images' files)."""
        return self._thread.is_alive()

    def _publish_positions(self) -> None:
        for index, job in enumerate(self._waiting, start=1):
            if job.position != index:
                job.position = index
                job.emit(Queued(position=index))

    def _pick(self, resident: tuple[CanonicalAdapter, ...]) -> int:
        """Index of the job to run next: see the class docstring."""
        head = self._waiting[0]
        if head.uses(resident) or head.times_bypassed >= self.max_bypass:
            return 0
        for index, job in enumerate(self._waiting[1:], start=1):
            if job.uses(resident):
                for passed in self._waiting[:index]:
                    passed.times_bypassed += 1
                return index
        return 0

    def _next_job(self, runtime: DiffusionRuntime) -> GenerationJob | None:
        """The job to run next."""
        with self._cond:
            while not self._waiting and not self._stopped:
                self._cond.wait()
            if not self._waiting:
                return None
            job = self._waiting.pop(self._pick(runtime.residency.resident_adapters))
            self._running = job
            self._publish_positions()
            return job

    def _work(self) -> None:
        try:
            runtime = self._runtime_factory(self.startup_stop)
        except StartupStopped as stopped:  # not a failure: whoever awaits `ready` says where it stopped
            self.ready.set_exception(stopped)
            return
        except (StartupError, SettingsError) as exc:  # one line for whoever starts the server: no traceback
            log.error("start-up failed: %s", exc)
            self.ready.set_exception(exc)
            return
        except BaseException as exc:  # start-up failure: report it to whoever awaits `ready`
            log.exception("start-up failed")
            self.ready.set_exception(exc)
            return
        self.ready.set_result(runtime)
        try:
            while (job := self._next_job(runtime)) is not None:
                try:
                    if not job.cancelled.is_set():
                        self._run(runtime, job)
                finally:
                    with self._cond:
                        self._running = None
        finally:
            self._encoder.close()

    def _run(self, runtime: DiffusionRuntime, job: GenerationJob) -> None:
        queue_ms = (time.perf_counter() - job.enqueued_at) * 1000.0
        self._observer.job_dequeued(queue_ms / 1000.0)
        params = job.params
        fused = runtime.fuse_choice(job.stack, params)
        on_swap = None
        if runtime.needs_swap(job.stack, fused):
            self.swaps += 1
            # Cold: this request waited for an adapter to be read and converted; warm: all were cached.
            path = SwapPath.COLD if job.adapter_load_ms > 0 else SwapPath.WARM

            def on_swap(swap_ms: float, fused: bool) -> None:  # fused as done (auto may fall back to unfused)
                mode = SwapMode.FUSED if fused and job.stack else SwapMode.UNFUSED
                self._observer.swapped(path, mode, swap_ms / 1000.0)

        step_ended_ms = 0.0

        def on_step(progress) -> None:
            nonlocal step_ended_ms
            self._observer.step_done((progress.elapsed_ms - step_ended_ms) / 1000.0)
            step_ended_ms = progress.elapsed_ms
            job.emit(progress)

        try:
            decoded = runtime.render(
                job.params,
                job.stack,
                on_step=on_step,
                on_swap=on_swap,
                is_cancelled=job.cancelled.is_set,
                timings=Timings(queue_ms=queue_ms, adapter_load_ms=job.adapter_load_ms),
                warnings=job.warnings,
                fused=fused,
            )
        except EngineError as exc:
            job.emit(job.abort_error or exc)
        except Exception as exc:  # a pipeline failure must not take the worker down
            self._failed(job, exc)
        else:
            self._encoder.submit(decoded, lambda image: self._finished(job, image), lambda exc: self._failed(job, exc))

    def _finished(self, job: GenerationJob, image: GeneratedImage) -> None:
        self._observer.image_done()
        job.emit(image)

    @staticmethod
    def _failed(job: GenerationJob, exc: Exception) -> None:
        """A job whose pipeline run or image encoding raised something unforeseen: its caller gets GENERATION_FAILED."""
        log.error("generation failed", exc_info=exc)
        job.emit(GenerationFailedError(f"generation failed ({type(exc).__name__}); the server keeps serving"))
