"""--attention and --device-adapter-bytes: what is refused at start-up, and what a CPU server runs instead.

Every name --attention takes is diffusers' own (AttentionBackendName); an unknown one stops `serve` with one line
listing them. On CUDA a backend whose package is missing is refused too (diffusers' own requirement check, which
needs no GPU to run). Both are the pre-flight's refusals (pipeline/preflight.py), which `serve` asks right after
parsing its settings. Off CUDA a known name is accepted and the native backend runs, said in one log line.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal

import pytest
import torch

from loraswap.server import cli
from loraswap.server.config import Settings, SettingsError, add_serve_arguments, settings_from_args
from loraswap.server.engine import quiet_imports
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.attention import (
    NATIVE,
    apply_attention,
    attention_backends,
    check_attention,
    resolve_attention,
)
from loraswap.server.engine.pipeline.preflight import preflight

torch.set_num_threads(1)


def _settings(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ=environ or {})
    return settings_from_args(parser.parse_args(argv))


def _preflight(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    """The settings `serve` makes of these flags, once the pre-flight has passed them."""
    settings = _settings(argv, environ)
    preflight(settings.engine)
    return settings


@pytest.mark.parametrize(
    ("argv", "environ", "says"),
    [
        (["--attention", "flash-attention-9"], {}, "--attention 'flash-attention-9' is not an attention backend"),
        ([], {"LORASWAP_ATTENTION": "fastest"}, "--attention 'fastest' is not an attention backend"),
        (["--device-adapter-bytes", "-1"], {}, "--device-adapter-bytes -1 is negative"),
        ([], {"LORASWAP_DEVICE_ADAPTER_BYTES": "-5"}, "--device-adapter-bytes -5 is negative"),
        ([], {"LORASWAP_DEVICE_ADAPTER_BYTES": "lots"}, "LORASWAP_DEVICE_ADAPTER_BYTES='lots' is not valid"),
    ],
)
def test_bad_values_are_refused_in_one_line(argv, environ, says):
    with pytest.raises(SettingsError) as caught:
        _preflight(argv, environ)
    message = str(caught.value)
    assert says in message and "\n" not in message


def test_the_attention_backend_is_the_preflights_question_not_the_configs():
    # EngineConfig imports no diffusers: it takes any name, and the pre-flight refuses an unknown one.
    config = EngineConfig(attention="warp-drive")
    with pytest.raises(SettingsError, match="--attention 'warp-drive' is not an attention backend"):
        preflight(config)


def test_serve_runs_the_preflight_before_it_serves(monkeypatch, capsys):
    # Stand-ins: the real quieting marks torchao absent for the rest of this process, and serving is what the
    # pre-flight must come before.
    monkeypatch.setattr(quiet_imports, "quiet_foreign_packages", lambda quantize: None)
    monkeypatch.setattr("loraswap.server.app.serve", lambda settings: pytest.fail("serve() ran"))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={})
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        exit_code = cli.run_serve(parser.parse_args(["--attention", "warp-drive"]))
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_code == cli.EXIT_BAD_SETTINGS
    assert len(err) == 1 and err[0].startswith("loraswap serve: --attention 'warp-drive' is not an attention backend")


def test_an_unknown_backend_is_answered_with_every_choice():
    with pytest.raises(SettingsError) as caught:
        _preflight(["--attention", "bogus"])
    listed = str(caught.value).split("use one of ", 1)[1].split(", ")
    assert set(listed) == set(attention_backends())
    assert {"native", "flash", "_flash_3", "flex", "sage", "xformers"} <= set(listed)


@pytest.mark.parametrize(
    ("name", "module", "package"),
    [
        ("flash", "flash_attn", "flash-attn"),
        ("_flash_3", "flash_attn_interface", "FA3"),
        ("xformers", "xformers", "xformers"),
    ],
)
def test_on_cuda_a_backend_whose_package_is_missing_is_refused(name, module, package):
    # diffusers' requirement check runs without a GPU: it only asks whether the package is there.
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(SettingsError) as caught:
        preflight(EngineConfig(device="cuda", attention=name))
    message = str(caught.value)
    assert message.startswith(f"--attention {name} cannot run here:") and package in message
    assert "\n" not in message


def test_on_cpu_a_known_backend_is_accepted_and_the_native_one_runs(caplog):
    settings = _preflight(["--attention", "FLASH", "--device", "cpu", "--device-adapter-bytes", "1048576"])
    assert settings.engine.attention == "FLASH"
    assert settings.engine.device_adapter_bytes == 1048576
    with caplog.at_level(logging.WARNING, logger="loraswap.server.engine.pipeline.attention"):
        assert resolve_attention("FLASH", torch.device("cpu")) == NATIVE
    assert [record.getMessage() for record in caplog.records] == [
        "--attention flash needs CUDA; cpu runs the native backend (torch SDPA)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loraswap.server.engine.pipeline.attention"):
        assert resolve_attention(None, torch.device("cpu")) == NATIVE
        assert resolve_attention("native", torch.device("cpu")) == NATIVE
    assert caplog.records == []


def test_check_attention_takes_any_spelling_of_a_known_name_and_none():
    check_attention(None, "cpu")
    check_attention("Native", "cpu")
    check_attention("_flash_3_hub", "cpu")  # hub kernels are fetched at start-up on CUDA only


def test_flux_attention_dispatches_through_the_backend_that_is_set():
    transformer = builtin_model("tiny-flux").build().transformer
    processors = [module.processor for module in transformer.modules() if hasattr(module, "processor")]
    assert processors and all(processor._attention_backend is None for processor in processors)
    assert apply_attention(transformer, NATIVE) == NATIVE
    assert {str(processor._attention_backend.value) for processor in processors} == {NATIVE}


def test_sdxl_attention_calls_torch_itself_and_runs_native(caplog):
    unet = builtin_model("tiny-sdxl").build().unet
    with caplog.at_level(logging.WARNING, logger="loraswap.server.engine.pipeline.attention"):
        assert apply_attention(unet, "flex") == NATIVE
    assert "does not go through diffusers' backends" in caplog.text
