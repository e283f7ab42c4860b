"""`loraswap serve` as users run it: a process, flags and env, a port the OS picks, SIGTERM to stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import torch

from loraswap.client import LoraswapClient
from loraswap.server.engine.models import builtin_model
from tests.support.images import assert_images_close, decode
from tests.support.servers import TEST_TORCH_THREADS
from tests.support.streams import generate_in_background


def start_serve(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--host", "127.0.0.1", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "LORASWAP_TORCH_THREADS": str(TEST_TORCH_THREADS), **(env or {})},
    )
    for line in process.stdout:
        match = re.search(r"serving .* on port (\d+)", line)
        if match:
            return process, int(match.group(1))
    process.kill()
    raise AssertionError(f"server exited before serving (code {process.wait()})")


def test_env_configures_the_server_and_sigterm_exits_cleanly():
    process, port = start_serve(env={"LORASWAP_MODEL": "tiny-sdxl", "LORASWAP_MAX_RANK": "12"})
    try:
        with LoraswapClient(f"127.0.0.1:{port}", default_timeout=60) as client:
            info = client.server_info()
            assert (info.model, info.family, info.max_rank) == ("tiny-sdxl", "sdxl", 12)
            assert client.generate_image("a red circle", seed=1, num_inference_steps=2).data
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_exported_model_folder_serves_the_same_images_as_the_builtin(exported_models):
    """`--model DIR` loads through plain diffusers from_pretrained and draws what the built-in draws."""
    process, port = start_serve("--model", str(exported_models["tiny-flux"]), "--no-compile")
    try:
        with LoraswapClient(f"127.0.0.1:{port}", default_timeout=60) as client:
            info = client.server_info()
            exported_image = client.generate_image("a blue square", seed=3, num_inference_steps=3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert info.family == "flux" and not info.compiled
    pipe = builtin_model("tiny-flux").build()
    expected = pipe(
        prompt="a blue square", num_inference_steps=3, guidance_scale=3.5, width=64, height=64,
        max_sequence_length=32, generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]  # fmt: skip
    assert_images_close(decode(exported_image.data), np.asarray(expected.convert("RGB")).astype(np.int32))


def test_sigterm_drains_running_and_queued_work_then_exits_0():
    from loraswap.client import GeneratedImage, LoraswapError

    process, port = start_serve("--no-compile", "--grace-seconds", "60")
    try:
        running_thread, running, first_step = generate_in_background(port, steps=150, seed=1)
        first_step.wait(30)
        queued_thread, queued, _ = generate_in_background(port, steps=5, seed=2)
        import time

        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with LoraswapClient(f"127.0.0.1:{port}", default_timeout=10, wait_for_ready=False) as late:
            try:
                late.generate_image("too late", seed=3, num_inference_steps=2)
                raise AssertionError("a call after SIGTERM was served")
            except LoraswapError as error:
                assert error.code.name == "UNAVAILABLE"
        running_thread.join(60)
        queued_thread.join(60)
        assert isinstance(running.get("last"), GeneratedImage), running
        assert isinstance(queued.get("last"), GeneratedImage), queued
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_past_the_grace_fails_the_rest_with_unavailable_and_exits_0():
    process, port = start_serve("--no-compile", "--grace-seconds", "0.3")
    try:
        thread, outcome, first_step = generate_in_background(port, steps=200, seed=1)
        first_step.wait(30)
        process.send_signal(signal.SIGTERM)
        thread.join(60)
        error = outcome.get("error")
        assert error is not None and (error.code.name, error.reason) == ("UNAVAILABLE", "SHUTTING_DOWN"), outcome
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_default_serve_draws_with_the_shipped_shapes_adapters():
    process, port = start_serve("--no-compile")
    try:
        with LoraswapClient(f"127.0.0.1:{port}", default_timeout=60) as client:
            assert client.server_info().model == "shapes"
            base = client.generate_image("a red square on a blue background", seed=1)
            outlined = client.generate_image("a red square on a blue background", adapter="outline", seed=1)
        assert outlined.adapter == "outline"
        assert np.abs(decode(base.data) - decode(outlined.data)).max() > 100  # hollow: the centre turns blue
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


# Lines other packages print at start-up that say nothing about loraswap (torchao's optional kernels, its torch
# pytree deprecations, diffusers' torchao notice, transformers' torchvision fallbacks, loading bars).
FOREIGN_NOISE = re.compile(
    r"Failed to load|Unable to import|torchvision|deprecated|Loading pipeline components|Loading weights"
)


def test_a_default_serve_starts_with_loraswaps_own_lines_only():
    """`loraswap serve` with the defaults: its stderr, from start to SERVING and stop, holds loraswap's log lines
    and nothing from the packages it imports; torchao is not even imported (nothing asks to quantize)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "loraswap.client.command", "serve", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LORASWAP_TORCH_THREADS": str(TEST_TORCH_THREADS), "LORASWAP_LOG_LEVEL": "DEBUG"},
    )
    try:
        for line in process.stdout:
            if "serving shapes on port" in line:
                break
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert "start-up load" in stderr and "ready: shapes" in stderr
    noise = [line for line in stderr.splitlines() if FOREIGN_NOISE.search(line)]
    assert noise == []
    assert "torchao" not in stderr
