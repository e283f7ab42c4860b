"""A Generate streamed on a thread of its own, for tests that signal a server while it runs."""

from __future__ import annotations

import threading

from loraswap.client import LoraswapClient, LoraswapError, Progress


def generate_in_background(
    port: int, steps: int, seed: int, size: int | None = None
) -> tuple[threading.Thread, dict, threading.Event]:
    """Start a Generate on its own thread (`size`: width and height, default the model's).

    Returns (the thread, its outcome: {"events": [...], "last": the last event, "error": a LoraswapError}, an
    event set at its first step, or when it ended without one).
    """
    outcome: dict = {"events": []}
    first_step = threading.Event()
    dimensions = {} if size is None else {"width": size, "height": size}

    def run() -> None:
        try:
            with LoraswapClient(f"127.0.0.1:{port}", default_timeout=120) as client:
                for event in client.generate("drain me", seed=seed, num_inference_steps=steps, **dimensions):
                    outcome["events"].append(event)
                    outcome["last"] = event
                    if isinstance(event, Progress):
                        first_step.set()
        except LoraswapError as error:
            outcome["error"] = error
        finally:
            first_step.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome, first_step
