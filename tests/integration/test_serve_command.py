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
from loraswap.engine.models import build_builtin_pipeline
from tests.conftest import TEST_TORCH_THREADS, assert_images_close, decode


def start_serve(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "loraswap.cli", "serve", "--host", "127.0.0.1", "--port", "0", *flags],
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
    pipe = build_builtin_pipeline("tiny-flux")
    expected = pipe(
        prompt="a blue square", num_inference_steps=3, guidance_scale=3.5, width=64, height=64,
        max_sequence_length=32, generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]  # fmt: skip
    assert_images_close(decode(exported_image.data), np.asarray(expected.convert("RGB")).astype(np.int32))
