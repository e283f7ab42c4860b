"""Rank buckets: the slot computes at the resident adapter's bucket (the base model at none), exactly and compiled once.

The slot tests compare a bucketed slot with one that always computes at the full max rank, layer outputs and
whole denoiser forwards, for adapters in every bucket, stacks and the base model; compiled through the
graph-counting backend, every bucket is one graph made before the swaps and none is made by them.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from loraswap.server.config import SettingsError, add_serve_arguments, settings_from_args
from loraswap.server.engine.adapters.formats import CanonicalAdapter, CanonicalLayer
from loraswap.server.engine.adapters.residency import SLOT_ADAPTER_NAME
from loraswap.server.engine.families import FLUX
from loraswap.server.engine.models import builtin_model
from loraswap.server.engine.pipeline.compile import CountingBackend
from loraswap.server.engine.pipeline.target_layers import resolve_target_layers
from loraswap.server.engine.rank_buckets import bucket_for, default_rank_buckets, resolve_rank_buckets
from tests.support.slots import gates_match_resident, install_residency

torch.set_num_threads(1)

MAX_RANK = 16
BUCKETS = (4, 8, 16)


@pytest.mark.parametrize(
    ("requested", "max_rank", "expected"),
    [
        (None, 64, (16, 32, 64)),
        ((), 64, (16, 32, 64)),
        (None, 16, (16,)),
        (None, 8, (8,)),
        (None, 128, (16, 32, 64, 128)),
        (None, 48, (16, 32, 48)),
        ((16, 32, 64), 64, (16, 32, 64)),
        ((8, 32), 64, (8, 32, 64)),  # max rank appended
        ((64,), 64, (64,)),
        ((1,), 1, (1,)),
    ],
)
def test_buckets_resolve(requested, max_rank, expected):
    assert resolve_rank_buckets(requested, max_rank) == expected
    assert default_rank_buckets(max_rank)[-1] == max_rank


@pytest.mark.parametrize(
    ("requested", "says"),
    [
        ((32, 16, 64), "ascending"),
        ((16, 16, 64), "ascending"),
        ((0, 64), "outside 1..64"),
        ((16, 128), "outside 1..64"),
        ((-8,), "outside 1..64"),
    ],
)
def test_bad_buckets_are_refused_in_one_line(requested, says):
    with pytest.raises(ValueError, match=says) as caught:
        resolve_rank_buckets(requested, 64)
    assert "\n" not in str(caught.value) and "--rank-buckets" in str(caught.value)


def _settings(argv, environ=None):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ=environ or {})
    return settings_from_args(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("argv", "environ", "says"),
    [
        (["--rank-buckets", "64,32"], {}, "ascending"),
        (["--rank-buckets", "16,32,128"], {}, "outside 1..64"),
        (["--max-rank", "16", "--rank-buckets", "8,32"], {}, "outside 1..16"),
        ([], {"LORASWAP_RANK_BUCKETS": "16,x"}, "LORASWAP_RANK_BUCKETS"),
        ([], {"LORASWAP_RANK_BUCKETS": "32,16"}, "ascending"),
    ],
)
def test_bad_flag_or_variable_is_refused_at_start_up(argv, environ, says):
    with pytest.raises(SettingsError, match=says) as caught:
        _settings(argv, environ)
    assert "\n" not in str(caught.value)


def test_a_bad_flag_value_is_an_argparse_error_that_says_what_to_give(capsys):
    with pytest.raises(SystemExit):
        _settings(["--rank-buckets", "sixteen"])
    assert "give e.g. --rank-buckets 16,32,64" in capsys.readouterr().err


def test_flag_and_variable_set_the_buckets():
    assert _settings(["--rank-buckets", "8,16"], {}).engine.rank_buckets == (8, 16)
    assert _settings([], {"LORASWAP_RANK_BUCKETS": "8,16"}).engine.rank_buckets == (8, 16)
    assert _settings([], {"LORASWAP_RANK_BUCKETS": ""}).engine.rank_buckets is None


def test_bucket_for_picks_the_smallest_that_holds_the_rank():
    assert [bucket_for(rank, BUCKETS) for rank in (0, 1, 4, 5, 8, 9, 16)] == [0, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError):
        bucket_for(17, BUCKETS)


# -- the slot ---------------------------------------------------------------------------------------------


def _transformer_with_slot(rank_buckets):
    torch.manual_seed(0)  # the same random weights for every copy
    transformer = builtin_model("tiny-flux").build().transformer
    layers = resolve_target_layers(transformer, FLUX.default_target_modules)
    return transformer, layers, install_residency(transformer, layers, MAX_RANK, torch.float32, rank_buckets)


def _adapter(transformer, layers, rank: int, seed: int, every: int = 1) -> CanonicalAdapter:
    generator = torch.Generator().manual_seed(seed)
    canonical = {}
    for name in layers[::every]:
        base = transformer.get_submodule(name).base_layer
        a = torch.randn(rank, base.in_features, generator=generator) * 0.3
        b = torch.randn(base.out_features, rank, generator=generator) * 0.3
        canonical[name] = CanonicalLayer(a=a, b=b)
    return CanonicalAdapter(name=f"r{rank}-{seed}", source="test", layers=canonical, warnings=(), load_ms=0.0)


def _inputs(transformer) -> dict:
    config = transformer.config
    generator = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 16, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, 8, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=generator),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5]) if config.guidance_embeds else None,
        return_dict=False,
    )


def test_the_bucket_follows_the_resident_rank_and_the_base_model_skips_the_branch():
    transformer, layers, slot = _transformer_with_slot(BUCKETS)
    assert slot.slot.rank_buckets == BUCKETS and slot.slot.graph_buckets == (0, *BUCKETS)
    lora_layer = transformer.get_submodule(layers[0])
    for adapters, expected in [
        ([(2, 1.0)], 4),
        ([(4, 0.5)], 4),
        ([(5, 1.0)], 8),
        ([(16, 1.0)], 16),
        ([], 0),
        ([(4, 1.0), (2, 1.0)], 8),  # a stack: its summed rank
        ([(8, 1.0), (4, 1.0)], 16),
    ]:
        slot.load_stack([(_adapter(transformer, layers, rank, seed=rank), scale) for rank, scale in adapters])
        assert slot.bucket == expected
        assert lora_layer.disable_adapters == (expected == 0)
        if expected:
            assert lora_layer.lora_A[SLOT_ADAPTER_NAME].rank_bucket == expected
            assert lora_layer.lora_B[SLOT_ADAPTER_NAME].rank_bucket == expected
    # Nothing was reallocated: the factors are the same tensors at the same addresses.
    assert lora_layer.lora_A[SLOT_ADAPTER_NAME].weight.shape[0] == MAX_RANK


def test_computing_at_a_higher_bucket_changes_no_output_and_refuses_a_lower_one():
    transformer, layers, slot = _transformer_with_slot(BUCKETS)
    adapter = _adapter(transformer, layers, 5, seed=3)
    slot.load_stack([(adapter, 0.8)])
    inputs = _inputs(transformer)
    with torch.inference_mode():
        at_own = transformer(**inputs)[0]
        with slot.computing_at(16):
            assert slot.bucket == 16
            wider = transformer(**inputs)[0]
        assert slot.bucket == 8
        with pytest.raises(ValueError), slot.computing_at(4):
            pass
    torch.testing.assert_close(wider, at_own, rtol=1e-5, atol=1e-5)


def _sequence(transformer, layers) -> list[list]:
    """Adapters in each bucket, stacks, a partial adapter and the base model, moving up and down the buckets."""
    r2, r5, r16 = (_adapter(transformer, layers, rank, seed=rank) for rank in (2, 5, 16))
    partial = _adapter(transformer, layers, 8, seed=8, every=3)
    return [
        [],
        [(r2, 1.0)],
        [(r16, 0.7)],
        [(r5, -1.0)],
        [],
        [(r2, 1.0), (r5, 0.5)],  # 7: bucket 8
        [(partial, 1.2), (r5, 1.0)],  # 13 on a third of the layers: bucket 16
        [(r2, 1.5)],
        [(partial, 1.0)],
        [],
    ]


def test_bucketed_slot_matches_a_full_width_slot_and_the_base_model_is_the_bare_model():
    bucketed, layers, slot = _transformer_with_slot(BUCKETS)
    full, _, full_slot = _transformer_with_slot(None)
    torch.manual_seed(0)
    bare = builtin_model("tiny-flux").build().transformer  # no LoRA at all
    inputs = _inputs(bucketed)
    with torch.inference_mode():
        expected_base = bare(**inputs)[0]
        for members in _sequence(bucketed, layers):
            slot.load_stack(members)
            full_slot.load_stack(members)
            actual, expected = bucketed(**inputs)[0], full(**inputs)[0]
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
            if not members:
                # The base model skips the LoRA branch: exactly the model without any LoRA.
                assert torch.equal(actual, expected_base)
            else:
                assert (actual - expected_base).abs().max() > 1e-3  # the adapter really acts
    assert gates_match_resident(slot.slot)


def test_swaps_between_buckets_compile_nothing_after_the_warm_up():
    """One double-stream block compiled (what dynamo specialises on is the same as for the whole model, faster)."""
    bucketed, layers, slot = _transformer_with_slot(BUCKETS)
    full, _, full_slot = _transformer_with_slot(None)
    captured = {}

    def capture(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    with torch.inference_mode():
        handle = bucketed.transformer_blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
        bucketed(**_inputs(bucketed))
        handle.remove()
    args, kwargs = captured["call"]
    block, full_block = bucketed.transformer_blocks[0], full.transformer_blocks[0]
    counter = CountingBackend("eager")
    block.compile(backend=counter)
    with torch.inference_mode():
        for bucket in slot.slot.graph_buckets:  # the warm-up: one graph per bucket, the base model's included
            with slot.computing_at(bucket):
                block(*args, **kwargs)
        assert counter.graphs_compiled == len(slot.slot.graph_buckets)
        for members in _sequence(bucketed, layers):
            slot.load_stack(members)
            full_slot.load_stack(members)
            for actual, expected in zip(block(*args, **kwargs), full_block(*args, **kwargs)):
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert counter.graphs_compiled == len(slot.slot.graph_buckets), "a swap compiled a graph"
