"""--compile, --compile-mode and --compile-cache: what the flags accept, what they refuse, how caches are keyed."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from loraswap.server.config import Settings, SettingsError, add_serve_arguments, settings_from_args
from loraswap.server.engine.compile_options import compile_mode_label, effective_compile_mode, resolve_compile_kind
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.compile_cache import CompileCacheKey, compile_cache_scope, runtime_cache_key


def _settings(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={} if environ is None else environ)
    return settings_from_args(parser.parse_args(argv))


# flags, environment, and the (compile, compile_mode, compile_cache) they must give
ACCEPTED = [
    ([], {}, (None, "default", None)),
    (["--compile"], {}, ("full", "default", None)),
    (["--compile", "full"], {}, ("full", "default", None)),
    (["--compile", "regional"], {}, ("regional", "default", None)),
    (["--compile", "none"], {}, ("none", "default", None)),
    (["--no-compile"], {}, ("none", "default", None)),
    ([], {"LORASWAP_COMPILE": "regional"}, ("regional", "default", None)),
    ([], {"LORASWAP_COMPILE": "true"}, ("full", "default", None)),  # the old switch's values
    ([], {"LORASWAP_COMPILE": "0"}, ("none", "default", None)),
    (["--no-compile"], {"LORASWAP_COMPILE": "regional"}, ("none", "default", None)),  # the flag wins
    (["--compile", "--compile-mode", "max-autotune"], {}, ("full", "max-autotune", None)),
    (["--compile", "regional"], {"LORASWAP_COMPILE_MODE": "reduce-overhead"}, ("regional", "reduce-overhead", None)),
    (["--compile-mode", "max-autotune-no-cudagraphs"], {}, (None, "max-autotune-no-cudagraphs", None)),
    (["--compile-cache", "/var/cache/loraswap"], {}, (None, "default", Path("/var/cache/loraswap"))),
    ([], {"LORASWAP_COMPILE_CACHE": "/cache"}, (None, "default", Path("/cache"))),
    ([], {"LORASWAP_COMPILE_CACHE": ""}, (None, "default", None)),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "environ", "expected"), ACCEPTED)
def test_compile_flags_and_their_variables(argv, environ, expected) -> None:
    engine = _settings(argv, environ).engine
    assert (engine.compile, engine.compile_mode, engine.compile_cache) == expected


# flags, environment, and a word the one-line refusal must contain
REFUSED = [
    ([], {"LORASWAP_COMPILE": "partial"}, "LORASWAP_COMPILE"),
    ([], {"LORASWAP_COMPILE_MODE": "fastest"}, "LORASWAP_COMPILE_MODE"),
    (["--compile-mode", "max-autotune", "--compile-backend", "aot_eager"], {}, "--compile-backend inductor"),
    (["--no-compile", "--compile-mode", "reduce-overhead"], {}, "--compile full"),
    ([], {"LORASWAP_COMPILE": "none", "LORASWAP_COMPILE_MODE": "max-autotune"}, "--compile full"),
]


@pytest.mark.parametrize(("argv", "environ", "named"), REFUSED)
def test_bad_compile_settings_are_refused_in_one_line(argv, environ, named) -> None:
    with pytest.raises(SettingsError) as refused:
        _settings(argv, environ)
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("argv", [["--compile", "partial"], ["--compile-mode", "fastest"]])
def test_bad_compile_flags_stop_the_parser(argv) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser, environ={})
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(argv)


def test_old_switch_values_in_code_mean_full_and_none() -> None:
    assert EngineConfig(compile=True) == EngineConfig(compile="full")
    assert EngineConfig(compile=False).compile == "none"


@pytest.mark.parametrize(
    ("mode", "device", "effective"),
    [
        ("reduce-overhead", "cpu", "default"),
        ("max-autotune", "cpu", "max-autotune-no-cudagraphs"),
        ("max-autotune-no-cudagraphs", "cpu", "max-autotune-no-cudagraphs"),
        ("default", "cpu", "default"),
        ("reduce-overhead", "cuda", "reduce-overhead"),
        ("max-autotune", "cuda", "max-autotune"),
    ],
)
def test_cuda_graph_modes_fall_back_off_cuda(mode: str, device: str, effective: str) -> None:
    assert effective_compile_mode(mode, device) == effective


def test_unset_compile_is_the_familys_kind_on_cuda_and_none_elsewhere() -> None:
    from loraswap.server.engine.families import FAMILIES, Z_IMAGE

    # Z-Image compiled whole would compile a graph for new prompt and negative prompt lengths: regional by default.
    assert {traits.family.value: traits.compile_kind for traits in FAMILIES.values()} == {
        "flux": "full", "sdxl": "full", "qwen-image": "full", "z-image": "regional", "flux2": "full",
    }  # fmt: skip
    assert resolve_compile_kind(None, "cuda", Z_IMAGE.compile_kind) == "regional"
    assert resolve_compile_kind(None, "cuda") == "full"
    assert resolve_compile_kind(None, "cpu", Z_IMAGE.compile_kind) == "none"
    assert resolve_compile_kind("full", "cuda", Z_IMAGE.compile_kind) == "full"  # as the operator says


def test_compile_mode_labels() -> None:
    assert compile_mode_label("full", "default") == "full/default"
    assert compile_mode_label("regional", "max-autotune") == "regional/max-autotune"
    assert compile_mode_label("none", "default") == "none"


KEY = CompileCacheKey(
    model="tiny-sdxl", layers=None, dtype="float32", device="cpu (x86_64, AVX2)", max_rank=16, rank_buckets=(16,),
    target_layers=("down.attn1.to_q", "down.attn1.to_k"), quantize="none", compile_kind="full",
    compile_backend="inductor", compile_mode="default", torch_version="2.13.0", diffusers_version="0.42.1",
    python_version="3.11",
)  # fmt: skip
# One change per field: each must lead to a folder of its own.
KEY_CHANGES = {
    "model": "tiny-flux", "layers": 2, "dtype": "bfloat16", "device": "cuda (NVIDIA H200, sm_90)", "max_rank": 64,
    "rank_buckets": (8, 16), "target_layers": ("down.attn1.to_q",), "quantize": "int8wo", "compile_kind": "regional",
    "compile_backend": "aot_eager", "compile_mode": "max-autotune", "torch_version": "2.14.0",
    "diffusers_version": "0.43.0", "python_version": "3.12",
}  # fmt: skip


def test_every_field_of_the_key_is_changed_here() -> None:
    assert set(KEY_CHANGES) == {field.name for field in dataclasses.fields(CompileCacheKey)}


@pytest.mark.parametrize(("field", "value"), KEY_CHANGES.items(), ids=list(KEY_CHANGES))
def test_cache_folder_changes_with_each_keyed_input(field: str, value, tmp_path: Path) -> None:
    changed = dataclasses.replace(KEY, **{field: value})
    assert changed.digest() != KEY.digest()
    assert changed.folder(tmp_path) != KEY.folder(tmp_path)
    assert dataclasses.replace(KEY).digest() == KEY.digest()  # and it is stable


def test_runtime_key_names_this_torch_and_a_local_model_by_its_path(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    settings = dict(
        layers=None, dtype=torch.float32, device=torch.device("cpu"), max_rank=16, rank_buckets=(16,),
        target_layers=("a",), quantize="none", compile_kind="full", compile_backend="inductor", compile_mode="default",
    )  # fmt: skip
    keys = [runtime_cache_key(model=name, **settings) for name in (str(model), "tiny-flux")]
    assert keys[0].model == str(model.resolve()) and keys[1].model == "tiny-flux"
    assert keys[0].torch_version == torch.__version__ and keys[0].device.startswith("cpu (")
    assert keys[0].dtype == "float32"


def test_a_second_compile_reads_the_cache_folder(tmp_path: Path) -> None:
    """Inductor writes its FX graph cache into the scope's folder, and a fresh compile there hits it."""
    from torch._dynamo.utils import counters

    folder = tmp_path / "compile-cache" / KEY.digest()
    # A bare matmul: inductor calls an extern kernel, so there is no C++ to build and the test stays quick.
    module = torch.nn.Linear(8, 8, bias=False)
    inputs = torch.randn(2, 8)
    with torch.no_grad():
        expected = module(inputs)
        for _ in range(2):
            torch._dynamo.reset()
            hits = counters["inductor"]["fxgraph_cache_hit"]
            with compile_cache_scope(folder):
                output = torch.compile(module, backend="inductor")(inputs)
            torch.testing.assert_close(output, expected)
        torch._dynamo.reset()
    assert any((folder / "fxgraph").rglob("*")), "nothing was written into the cache folder"
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
