"""load_canonical: real PEFT-written LoRA files against the real tiny models' slot specs.

The reference for what an adapter means is diffusers itself: a fresh tiny
pipeline that `load_lora_weights` the same file, whose PEFT layers give
`lora_B @ lora_A * scaling` per module. A canonical layer's `b @ a` must equal
that delta, so alpha/rank (and any per-layer alpha or rank) is baked into `b`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraswap.server.devtools.random_adapter import write_random_adapter
from loraswap.server.engine.adapters.formats import SlotSpec, load_canonical
from loraswap.server.engine.adapters.sources import AdapterFile
from loraswap.server.engine.errors import AdapterFormatError, AdapterIncompatibleError, EngineError
from loraswap.server.engine.models import builtin_model
from tests.support.lora_reference import (
    MAX_RANK,
    assert_same_deltas,
    canonical_deltas,
    diffusers_deltas,
    tiny_slot_specs,
)

torch.set_num_threads(1)

INIT_STD = 0.2


@pytest.fixture(scope="module")
def specs() -> dict[str, SlotSpec]:
    return tiny_slot_specs()


def _load(path: Path, spec: SlotSpec):
    return load_canonical(AdapterFile(name="test/adapter", path=path, source=f"file://{path}"), spec)


def _write_random(model: str, directory: Path, **kwargs) -> Path:
    return write_random_adapter(builtin_model(model).build(), directory, init_std=INIT_STD, **kwargs)


def _write_peft_flux(
    directory: Path, config: LoraConfig, *, text_encoder_layers=None, text_encoder_config=None
) -> Path:
    """A tiny-flux transformer LoRA for any LoraConfig, N(0, INIT_STD) factors, saved by diffusers."""
    pipe = builtin_model("tiny-flux").build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        pipe.transformer.add_adapter(config, adapter_name="test")
        state = get_peft_model_state_dict(pipe.transformer, adapter_name="test")
        state = {key: (torch.randn_like(value) * INIT_STD).contiguous() for key, value in state.items()}
    FluxPipeline.save_lora_weights(
        directory,
        transformer_lora_layers=state,
        text_encoder_lora_layers=text_encoder_layers,
        transformer_lora_adapter_metadata=config.to_dict(),
        text_encoder_lora_adapter_metadata=text_encoder_config.to_dict() if text_encoder_config else None,
    )
    return directory / "pytorch_lora_weights.safetensors"


def _raw_factors(path: Path, prefix: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    raw = load_file(str(path))
    modules = {key.removeprefix(prefix + ".").removesuffix(".lora_A.weight") for key in raw if ".lora_A." in key}
    return {m: (raw[f"{prefix}.{m}.lora_A.weight"], raw[f"{prefix}.{m}.lora_B.weight"]) for m in modules}


@pytest.mark.parametrize(
    ("model", "rank", "alpha", "targets"),
    [
        ("tiny-flux", 4, None, ("to_q", "to_k", "to_v", "to_out.0")),
        ("tiny-flux", 8, 2.0,
         ("add_q_proj", "to_add_out", "ff.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out")),
        ("tiny-flux", MAX_RANK, 64.0, ("to_q", "ff.net.2")),
        ("tiny-sdxl", 4, 16.0, ("to_q", "to_k", "to_v", "to_out.0")),
        ("tiny-sdxl", 2, 1.0, ("proj_in", "ff.net.0.proj", "ff.net.2", "attn2.to_k")),
    ],
)  # fmt: skip
def test_matches_diffusers(
    specs: dict[str, SlotSpec], tmp_path: Path, model: str, rank: int, alpha: float | None, targets: tuple[str, ...]
) -> None:
    spec = specs[model]
    path = _write_random(model, tmp_path, rank=rank, alpha=alpha, target_modules=targets)
    adapter = _load(path, spec)

    expected, _ = diffusers_deltas(model, path)
    assert_same_deltas(canonical_deltas(adapter), expected)
    assert adapter.name == "test/adapter"
    assert adapter.source == f"file://{path}"
    assert adapter.warnings == ()
    assert adapter.rank == rank
    for name, layer in adapter.layers.items():
        in_features, out_features = spec.layer_shapes[name]
        assert layer.a.shape == (rank, in_features)
        assert layer.b.shape == (out_features, rank)
        assert layer.a.dtype == layer.b.dtype == torch.float32
        assert layer.a.is_contiguous() and layer.b.is_contiguous()
    assert adapter.nbytes == sum(rank * sum(spec.layer_shapes[name]) * 4 for name in adapter.layers)


@pytest.mark.parametrize(("rank", "alpha"), [(4, 4.0), (4, 1.0), (8, 32.0), (2, 0.5)])
def test_alpha_is_baked_into_b_only(specs: dict[str, SlotSpec], tmp_path: Path, rank: int, alpha: float) -> None:
    """`a` is the file's lora_A untouched; `b` is lora_B times alpha/rank."""
    path = _write_random("tiny-flux", tmp_path, rank=rank, alpha=alpha, target_modules=("to_q", "to_v"))
    adapter = _load(path, specs["tiny-flux"])
    raw = _raw_factors(path, "transformer")
    assert adapter.layers.keys() == raw.keys()
    for name, (lora_a, lora_b) in raw.items():
        torch.testing.assert_close(adapter.layers[name].a, lora_a, rtol=0, atol=0)
        torch.testing.assert_close(adapter.layers[name].b, lora_b * (alpha / rank), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("config_kwargs", "expected_scale"),
    [
        (
            dict(r=4, lora_alpha=4, alpha_pattern={"to_q": 16, "single_transformer_blocks.0.attn.to_k": 1}),
            lambda name: 4.0 if name.endswith("to_q")
            else 0.25 if name == "single_transformer_blocks.0.attn.to_k"
            else 1.0,
        ),
        (
            dict(r=4, lora_alpha=8, rank_pattern={"to_v": 8}),
            lambda name: 1.0 if name.endswith("to_v") else 2.0,
        ),
        (
            dict(r=4, lora_alpha=2, rank_pattern={"to_k": 2}, alpha_pattern={"to_k": 6}),
            lambda name: 3.0 if name.endswith("to_k") else 0.5,
        ),
        (
            dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"to_v": 16}),
            lambda name: 8 / math.sqrt(16) if name.endswith("to_v") else 8 / math.sqrt(4),
        ),
    ],
    ids=["alpha_pattern", "rank_pattern", "both_patterns", "rslora"],
)  # fmt: skip
def test_per_layer_alpha_and_rank(
    specs: dict[str, SlotSpec], tmp_path: Path, config_kwargs: dict, expected_scale
) -> None:
    config = LoraConfig(target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False, **config_kwargs)
    path = _write_peft_flux(tmp_path, config)
    adapter = _load(path, specs["tiny-flux"])

    expected, _ = diffusers_deltas("tiny-flux", path)
    assert_same_deltas(canonical_deltas(adapter), expected)
    raw = _raw_factors(path, "transformer")
    for name, (lora_a, lora_b) in raw.items():
        assert adapter.layers[name].rank == lora_a.shape[0]
        torch.testing.assert_close(adapter.layers[name].b, lora_b * expected_scale(name), rtol=1e-6, atol=0, msg=name)
    assert adapter.rank == max(a.shape[0] for a, _ in raw.values())


@pytest.mark.parametrize(
    ("file_dtype", "slot_dtype", "atol"),
    [
        (torch.float32, torch.bfloat16, 2e-2),
        (torch.float16, torch.float32, 2e-3),
        (torch.bfloat16, torch.float16, 2e-2),
    ],
)
def test_converts_to_the_slot_dtype(
    specs: dict[str, SlotSpec], tmp_path: Path, file_dtype: torch.dtype, slot_dtype: torch.dtype, atol: float
) -> None:
    path = _write_random("tiny-flux", tmp_path / "f32", rank=4, alpha=8.0, target_modules=("to_q",))
    expected = canonical_deltas(_load(path, specs["tiny-flux"]))
    raw = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    cast = tmp_path / "cast.safetensors"
    save_file({key: value.to(file_dtype) for key, value in raw.items()}, str(cast), metadata=metadata)

    adapter = _load(cast, dataclasses.replace(specs["tiny-flux"], dtype=slot_dtype))
    for layer in adapter.layers.values():
        assert layer.a.dtype == layer.b.dtype == slot_dtype
    assert_same_deltas(canonical_deltas(adapter), expected, atol=atol)


def test_text_encoder_layers_applied_or_dropped_with_warning_or_refused(
    specs: dict[str, SlotSpec], tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(2)
    text_encoder_layers = {}
    for projection in ("q_proj", "v_proj"):
        module = f"text_model.encoder.layers.0.self_attn.{projection}"
        text_encoder_layers[f"{module}.lora_A.weight"] = torch.randn(4, 32, generator=generator)
        text_encoder_layers[f"{module}.lora_B.weight"] = torch.randn(32, 4, generator=generator)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q"], init_lora_weights=False)
    text_encoder_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    path = _write_peft_flux(
        tmp_path, config, text_encoder_layers=text_encoder_layers, text_encoder_config=text_encoder_config
    )

    adapter = _load(path, specs["tiny-flux"])
    expected, reference = diffusers_deltas("tiny-flux", path)
    assert_same_deltas(canonical_deltas(adapter), expected)
    # Applied (the default): each text-encoder layer's change is what diffusers' own load gives that layer.
    encoder_deltas = {}
    for name, module in reference.text_encoder.named_modules():
        if isinstance(module, LoraLayer):
            (key,) = module.lora_A.keys()
            encoder_deltas[name] = module.lora_B[key].weight @ module.lora_A[key].weight * module.scaling[key]
    # PEFT targets q_proj/v_proj of every encoder layer; those the file has no factors for start at lora_B = 0.
    encoder_deltas = {name: delta for name, delta in encoder_deltas.items() if delta.abs().max() > 0}
    assert len(encoder_deltas) == 2, "the text-encoder keys are real"
    changes = adapter.changes_in({"text_encoder"})
    assert {module for _, module in changes} == set(encoder_deltas)
    for (_, module), change in changes.items():
        torch.testing.assert_close(change.dense_delta(torch.device("cpu"), tuple(encoder_deltas[module].shape)),
                                   encoder_deltas[module], rtol=1e-5, atol=1e-6)  # fmt: skip
    assert adapter.warnings == () and adapter.layers_per_component("transformer") == {
        "text_encoder": 2, "transformer": len(adapter.layers)
    }  # fmt: skip

    ignoring = dataclasses.replace(specs["tiny-flux"], text_encoder_layers="ignore")
    dropped = _load(path, ignoring)
    assert dropped.changes == {} and canonical_deltas(dropped).keys() == expected.keys()
    (warning,) = dropped.warnings
    assert "text_encoder (2 layers)" in warning
    with pytest.raises(AdapterIncompatibleError) as raised:
        _load(path, dataclasses.replace(ignoring, strict=True))
    assert raised.value.reason == "ADAPTER_TEXT_ENCODER_LAYERS"


def test_rank_refusal_says_which_ranks(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    path = _write_random("tiny-flux", tmp_path, rank=MAX_RANK + 1, target_modules=("to_q",))
    with pytest.raises(AdapterIncompatibleError) as raised:
        _load(path, specs["tiny-flux"])
    assert raised.value.reason == "ADAPTER_RANK_TOO_HIGH"
    assert raised.value.metadata == {"rank": str(MAX_RANK + 1), "max_rank": str(MAX_RANK)}


# -- refusals: each builder writes a file into tmp_path and returns it with the spec to load it against -----


def _flux_file(tmp_path: Path, rank: int = 4, targets=("to_q", "to_k")) -> Path:
    return _write_random("tiny-flux", tmp_path / "base", rank=rank, target_modules=targets)


def _edited(tmp_path: Path, edit, *, keep_metadata: bool = True, lora_metadata: str | None = None) -> Path:
    """The flux base file with its tensors passed through `edit(dict) -> dict` and saved again.

    `lora_metadata` replaces the LoraConfig JSON diffusers stored in the header.
    """
    source = _flux_file(tmp_path)
    with safe_open(str(source), framework="pt") as handle:
        metadata = handle.metadata() if keep_metadata else None
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    if lora_metadata is not None:
        metadata = {"format": "pt", "lora_adapter_metadata": lora_metadata}
    path = tmp_path / "edited.safetensors"
    save_file({k: v.contiguous() for k, v in edit(tensors).items()}, str(path), metadata=metadata)
    return path


def _first(tensors: dict, part: str) -> str:
    return min(key for key in tensors if part in key)


def _replace(tensors: dict, part: str, make) -> dict:
    key = _first(tensors, part)
    return tensors | {key: make(tensors[key])}


def _poison(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """The tensor with one element set to `value`."""
    poisoned = tensor.clone()
    poisoned[0, -1] = value
    return poisoned


def _bytes_file(tmp_path: Path, make) -> Path:
    path = tmp_path / "raw.safetensors"
    path.write_bytes(make(_flux_file(tmp_path).read_bytes()))
    return path


def _flux(builder):
    return lambda tmp_path, specs: (builder(tmp_path), specs["tiny-flux"])


_Q = "transformer.transformer_blocks.0.attn.to_q"  # a 32 -> 32 layer of tiny-flux
_KOHYA = "lora_unet_double_blocks_0_img_attn_proj"  # kohya's name for another


def _lora_config(**fields) -> str:
    """diffusers' lora_adapter_metadata JSON for a rank-4 transformer LoRA with `fields` added."""
    return json.dumps({f"transformer.{key}": value for key, value in {"r": 4, "lora_alpha": 4, **fields}.items()})


REFUSALS = [
    pytest.param(
        _flux(lambda t: _flux_file(t, rank=MAX_RANK * 2)),
        AdapterIncompatibleError, "ADAPTER_RANK_TOO_HIGH", id="rank_above_max",
    ),
    pytest.param(
        lambda t, s: (_flux_file(t), dataclasses.replace(
            s["tiny-flux"], layer_shapes={k: v for k, v in s["tiny-flux"].layer_shapes.items() if "to_k" not in k})),
        AdapterIncompatibleError, "ADAPTER_LAYER_NOT_TARGETED", id="layer_outside_narrow_slot",
    ),
    pytest.param(
        _flux(lambda t: _flux_file(t, targets=("to_q", "norm1.linear"))),
        AdapterIncompatibleError, "ADAPTER_LAYER_NOT_TARGETED", id="norm1_linear",
    ),
    pytest.param(
        lambda t, s: (_write_random("tiny-sdxl", t, rank=4), s["tiny-flux"]),
        AdapterFormatError, "ADAPTER_NO_DENOISER_LAYERS", id="sdxl_adapter_on_flux",
    ),
    pytest.param(
        lambda t, s: (_flux_file(t), s["tiny-sdxl"]),
        AdapterFormatError, "ADAPTER_NO_DENOISER_LAYERS", id="flux_adapter_on_sdxl",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_A", lambda v: torch.randn(v.shape[0], v.shape[1] + 1)))),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="in_features_mismatch",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_B", lambda v: torch.randn(v.shape[0] * 2, v.shape[1])))),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="out_features_mismatch",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_B", lambda v: torch.randn(v.shape[0], v.shape[1] - 1)))),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="rank_mismatch_between_a_and_b",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_A", lambda v: v.reshape(*v.shape, 1)))),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="conv_shaped_factor",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_A", lambda v: (v * 100).to(torch.int8)))),
        AdapterFormatError, "ADAPTER_BAD_DTYPE", id="int8_factor",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {k: (v * 100).to(torch.int32) for k, v in d.items()})),
        AdapterFormatError, "ADAPTER_BAD_DTYPE", id="all_int32",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_B", lambda v: _poison(v, float("nan"))))),
        AdapterFormatError, "ADAPTER_NOT_FINITE", id="nan",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_A", lambda v: _poison(v, float("-inf"))))),
        AdapterFormatError, "ADAPTER_NOT_FINITE", id="inf",
    ),
    pytest.param(
        _flux(lambda t: _edited(
            t, lambda d: d,
            lora_metadata='{"transformer.r": 4, "transformer.lora_alpha": Infinity, "transformer.target_modules": ["to_q", "to_k"]}',
        )),
        AdapterFormatError, "ADAPTER_NOT_FINITE", id="alpha_infinite",
    ),
    pytest.param(
        # Finite in float32, but 8x (the largest strength) is not: the slot needs lora_B finite at any strength.
        _flux(lambda t: _edited(t, lambda d: _replace(d, "lora_B", lambda v: _poison(v, 1e38)))),
        AdapterFormatError, "ADAPTER_OUT_OF_RANGE", id="b_overflows_at_max_strength",
    ),
    pytest.param(
        lambda t, s: (
            _edited(t, lambda d: _replace(d, "lora_A", lambda v: _poison(v, 1e6))),
            dataclasses.replace(s["tiny-flux"], dtype=torch.float16),
        ),
        AdapterFormatError, "ADAPTER_OUT_OF_RANGE", id="a_overflows_float16",
    ),
    pytest.param(
        lambda t, s: (
            _edited(t, lambda d: _replace(d, "lora_B", lambda v: _poison(v, 10000.0))),
            dataclasses.replace(s["tiny-flux"], dtype=torch.float16),
        ),
        AdapterFormatError, "ADAPTER_OUT_OF_RANGE", id="b_overflows_float16_at_max_strength",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {k: v for k, v in d.items() if k != _first(d, "lora_B")})),
        AdapterFormatError, "ADAPTER_MALFORMED", id="lora_a_without_lora_b",
    ),
    pytest.param(
        _flux(lambda t: _bytes_file(t, lambda b: b[: len(b) // 2])),
        AdapterFormatError, "ADAPTER_MALFORMED", id="truncated",
    ),
    pytest.param(
        _flux(lambda t: _bytes_file(t, lambda b: bytes(range(256)) * 8)),
        AdapterFormatError, "ADAPTER_MALFORMED", id="garbage",
    ),
    pytest.param(
        _flux(lambda t: _bytes_file(t, lambda b: b"")),
        AdapterFormatError, "ADAPTER_MALFORMED", id="zero_bytes",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {})),
        AdapterFormatError, "ADAPTER_MALFORMED", id="no_tensors",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata='{"transformer.r": 4')),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_not_json",
    ),
    pytest.param(
        _flux(lambda t: _write_peft_flux(t, LoraConfig(r=4, target_modules=["to_q"], lora_bias=True))),
        AdapterFormatError, "ADAPTER_UNSUPPORTED_TENSORS", id="lora_bias",
        marks=pytest.mark.filterwarnings("ignore:.*invalid shape"),  # PEFT warns about 1-D lora_B.bias
    ),
    pytest.param(
        _flux(lambda t: _write_peft_flux(t, LoraConfig(r=4, target_modules=["to_q"], use_dora=True))),
        AdapterIncompatibleError, "ADAPTER_INCOMPATIBLE", id="dora",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {k: v for k, v in d.items() if "lora_A" not in k})),
        AdapterFormatError, "ADAPTER_MALFORMED", id="lora_b_only",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {k: v for k, v in d.items() if "lora_B" not in k}, keep_metadata=False)),
        AdapterFormatError, "ADAPTER_MALFORMED", id="lora_a_only_without_metadata",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata="[4, 4]")),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_json_not_an_object",
    ),
    # Metadata is untrusted: nothing in it may run as a regular expression or reach PEFT unchecked.
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(alpha_pattern={"([a-z_.0-9]|[a-z_.0-9])*Z": 2}))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_backtracking_pattern",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(rank_pattern={"to_q(": 8}))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_malformed_pattern",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(alpha_pattern={f"b{i}.to_q": 2 for i in range(2000)}))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_pattern_flood",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(alpha_pattern={"to_q": "2"}))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_pattern_value_not_a_number",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(lora_alpha=[4]))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_alpha_not_a_number",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(use_rslora="yes"))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_flag_not_a_bool",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata="[" * 100_000 + "]" * 100_000)),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_nested_too_deep",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: d, lora_metadata=_lora_config(notes="x" * (1 << 20)))),
        AdapterFormatError, "ADAPTER_BAD_METADATA", id="metadata_too_large",
    ),
    # Degenerate tensors: each used to end in a ZeroDivisionError or IndexError.
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {f"{_Q}.lora_A.weight": torch.zeros(0, 32), f"{_Q}.lora_B.weight": torch.zeros(32, 0)})),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="rank_0",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {f"{_Q}.lora_A.weight": torch.tensor(1.0), f"{_Q}.lora_B.weight": torch.tensor(1.0)})),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="0_dimensional_factors",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {f"{_KOHYA}.lora_down.weight": torch.zeros(0, 32),
                                              f"{_KOHYA}.lora_up.weight": torch.zeros(32, 0),
                                              f"{_KOHYA}.alpha": torch.tensor(4.0)}, keep_metadata=False)),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="rank_0_kohya",
    ),
    pytest.param(
        _flux(lambda t: _edited(t, lambda d: {f"{_KOHYA}.lora_down.weight": torch.tensor(1.0),
                                              f"{_KOHYA}.lora_up.weight": torch.tensor(1.0)}, keep_metadata=False)),
        AdapterFormatError, "ADAPTER_SHAPE_MISMATCH", id="0_dimensional_kohya",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("build", "error", "reason"), REFUSALS)
def test_refusals(specs: dict[str, SlotSpec], tmp_path: Path, build, error: type[EngineError], reason: str) -> None:
    path, spec = build(tmp_path, specs)
    with pytest.raises(EngineError) as raised:
        _load(path, spec)
    assert type(raised.value) is error
    assert raised.value.reason == reason


def test_messages_bound_what_they_echo(specs: dict[str, SlotSpec], tmp_path: Path) -> None:
    """A 20 KB tensor key is quoted shortened: gRPC would refuse a message that large (RESOURCE_EXHAUSTED)."""
    huge = "k" * 20_000
    path = _edited(tmp_path, lambda d: {**d, f"transformer.{huge}.bias": torch.ones(4)})
    with pytest.raises(AdapterFormatError) as raised:
        _load(path, specs["tiny-flux"])
    assert raised.value.reason == "ADAPTER_UNSUPPORTED_TENSORS"
    assert "kkkk\u2026" in raised.value.message and len(raised.value.message) < 1000


@pytest.mark.parametrize("change", ["truncate", "rewrite_in_place"])
def test_a_canonical_adapter_owns_its_bytes(specs: dict[str, SlotSpec], tmp_path: Path, change: str) -> None:
    """Nothing stays mapped from the file: changing it after the load changes no canonical tensor (nor crashes)."""
    path = _flux_file(tmp_path)
    adapter = _load(path, specs["tiny-flux"])
    before = {name: (layer.a.clone(), layer.b.clone()) for name, layer in adapter.layers.items()}
    if change == "truncate":
        os.truncate(path, 0)
    else:
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            handle.seek(size // 4)
            handle.write(b"\xff" * (size - size // 4))  # 0xffffffff is a NaN in float32
    for name, (a, b) in before.items():
        assert torch.equal(adapter.layers[name].a, a) and torch.equal(adapter.layers[name].b, b), name
        assert torch.isfinite(adapter.layers[name].b).all()
    # Read again, the changed file is validated anew.
    with pytest.raises(AdapterFormatError):
        _load(path, specs["tiny-flux"])


def test_a_file_that_grew_past_the_limit_since_it_was_found_is_refused(specs: dict[str, SlotSpec], tmp_path: Path):
    from loraswap.server.engine.errors import AdapterTooLargeError

    path = _flux_file(tmp_path)
    limit = path.stat().st_size - 1
    with pytest.raises(AdapterTooLargeError):
        load_canonical(AdapterFile(name="grown", path=path, source="grown", max_bytes=limit), specs["tiny-flux"])
