"""--fuse auto's rule as a pure function of the request and the server's constants: fused when the LoRA branch's
predicted cost over the request's steps exceeds the merge's."""

from __future__ import annotations

import pytest

from loraswap.server.engine.fuse_policy import (
    DEVICE_COSTS,
    DeviceCosts,
    LoraWork,
    MergeWork,
    buckets_auto_may_choose,
    choose_fused,
    device_costs,
    merge_ms,
    unfused_ms,
    warm_up_graphs,
)

# policy, fusing, has_adapters, bucket, unfused ms, merge ms, fused?
CHOICES = [
    ("auto", True, True, 16, 40.0, 30.0, True),  # the LoRA branch would cost more than the merge
    ("auto", True, True, 16, 30.0, 30.0, False),  # equal: not more, keep the slot
    ("auto", True, True, 16, 20.0, 30.0, False),
    ("auto", True, True, None, 0.0, 1e9, True),  # the slot cannot hold it (DoRA, rank past max): fused
    ("auto", True, False, 16, 100.0, 1.0, False),  # the base model: nothing to fuse
    ("auto", False, True, 16, 100.0, 1.0, False),  # int8 weight-only weights: auto never fuses
    ("always", True, True, 16, 0.0, 1e9, True),
    ("always", True, False, 16, 0.0, 0.0, False),
    ("never", True, True, 16, 100.0, 0.0, False),
    ("never", False, True, None, 100.0, 0.0, False),
]


@pytest.mark.parametrize(("policy", "fusing", "has_adapters", "bucket", "unfused", "merge", "fused"), CHOICES)
def test_choose_fused(policy, fusing, has_adapters, bucket, unfused, merge, fused) -> None:
    chosen = choose_fused(
        policy, fusing=fusing, has_adapters=has_adapters, bucket=bucket, unfused_cost_ms=unfused, merge_cost_ms=merge
    )
    assert chosen is fused


COSTS = DeviceCosts(
    lora_call_ns=1000.0, lora_mac_ns=0.01, merge_layer_ns=10_000.0, merge_byte_ns=0.1, merge_mac_ns=0.001
)
WORK = LoraWork(calls=10, macs_per_pixel=100.0, fixed_macs=50_000.0)


def test_the_unfused_cost_grows_with_steps_bucket_and_pixels_and_keeps_the_texts_fixed_part() -> None:
    one = unfused_ms(COSTS, WORK, 16, 1, 64 * 64)
    # 10 calls * 1 us + 16 * (100 * 4096 + 50000) MACs * 0.01 ns
    assert one == pytest.approx((10 * 1000.0 + 16 * (100 * 4096 + 50_000) * 0.01) / 1e6)
    assert unfused_ms(COSTS, WORK, 16, 20, 64 * 64) == pytest.approx(20 * one)
    assert unfused_ms(COSTS, WORK, 32, 1, 64 * 64) > one
    bigger = unfused_ms(COSTS, WORK, 16, 1, 128 * 128)
    assert one < bigger < 4 * one  # the text's rows do not grow with the image


def test_the_merge_cost_counts_layers_bytes_and_products() -> None:
    assert merge_ms(COSTS, MergeWork(layers=2, weight_bytes=1_000_000, product_macs=10_000_000)) == pytest.approx(
        (2 * 10_000.0 + 1_000_000 * 0.1 + 10_000_000 * 0.001) / 1e6
    )


def test_every_device_type_has_constants_and_unknown_ones_are_costed_as_a_gpu() -> None:
    assert {"cpu", "cuda"} <= DEVICE_COSTS.keys()
    assert device_costs("mps") == DEVICE_COSTS["cuda"]
    for costs in DEVICE_COSTS.values():
        assert all(value > 0 for value in vars(costs).values())


def test_auto_compiles_only_the_buckets_it_may_choose() -> None:
    """A bucket whose one step at the smallest image costs more unfused than a full merge is never chosen."""
    full = {16: MergeWork(10, 1_000_000, 16_000_000), 32: MergeWork(10, 1_000_000, 32_000_000),
            64: MergeWork(10, 1_000_000, 64_000_000)}  # fmt: skip
    cheap_steps = LoraWork(calls=1, macs_per_pixel=1.0, fixed_macs=0.0)
    assert buckets_auto_may_choose(COSTS, cheap_steps, (16, 32, 64), 64 * 64, full) == (16, 32, 64)
    dear_steps = LoraWork(calls=1000, macs_per_pixel=10_000.0, fixed_macs=0.0)
    assert buckets_auto_may_choose(COSTS, dear_steps, (16, 32, 64), 64 * 64, full) == ()
    assert warm_up_graphs("auto", True, (0, 16, 32, 64), (16,)) == (0, 16)
    assert warm_up_graphs("auto", True, (0, 16, 32, 64), ()) == (0,)
    assert warm_up_graphs("always", True, (0, 16, 32, 64), (16,)) == (0,)
    assert warm_up_graphs("auto", False, (0, 16, 32, 64), ()) == (0, 16, 32, 64)


def test_a_request_whose_guidance_halves_the_batch_halves_the_rows_not_the_calls() -> None:
    from loraswap.server.engine.families import FLUX, SDXL
    from loraswap.server.engine.types import ModelDefaults

    half = WORK.at_batch(0.5)
    assert (half.calls, half.macs_per_pixel, half.fixed_macs) == (WORK.calls, 50.0, 25_000.0)
    assert unfused_ms(COSTS, half, 16, 1, 64 * 64) < unfused_ms(COSTS, WORK, 16, 1, 64 * 64)
    pipe = object()  # a pipeline these families' rules do not read
    sdxl, dev = ModelDefaults(1024, 1024, 30, 5.0), ModelDefaults(1024, 1024, 28, 3.5)
    true_cfg = ModelDefaults(64, 64, 20, 0.0, true_cfg_scale=3.0)
    assert [SDXL.guidance_batch(pipe, sdxl, guidance) for guidance in (5.0, 1.0, 0.0)] == [2, 1, 1]
    assert FLUX.guidance_batch(pipe, dev, 3.5) == FLUX.guidance_batch(pipe, dev, 1.0) == 1
    # A FLUX.1 model that asks for true CFG (shapes) runs it at any guidance.
    assert FLUX.guidance_batch(pipe, true_cfg, 0.0) == FLUX.guidance_batch(pipe, true_cfg, 3.5) == 2


def test_only_flux2_klein_base_runs_classifier_free_guidance_and_warms_up_both_ways() -> None:
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    from loraswap.server.engine.families import FLUX2
    from loraswap.server.engine.types import ModelDefaults

    components = dict.fromkeys(("scheduler", "vae", "text_encoder", "tokenizer", "transformer"))
    base = Flux2KleinPipeline(**components, is_distilled=False)
    distilled = Flux2KleinPipeline(**components, is_distilled=True)
    dev = Flux2Pipeline(**components)
    defaults = ModelDefaults(1024, 1024, 50, 4.0, 512)
    assert (FLUX2.guidance_batch(base, defaults, 4.0), FLUX2.guidance_batch(base, defaults, 1.0)) == (2, 1)
    assert FLUX2.guidance_batch(distilled, defaults, 4.0) == FLUX2.guidance_batch(dev, defaults, 4.0) == 1
    assert FLUX2.warm_up_guidance(base, defaults) == (4.0, 1.0)
    assert FLUX2.warm_up_guidance(distilled, defaults) == FLUX2.warm_up_guidance(dev, defaults) == (None,)


def test_true_cfg_counts_two_images_a_step_in_calls_of_batch_one() -> None:
    # The cost model counts the images a step computes; the attention measurement one call's batch.
    from loraswap.server.engine.families import FLUX, QWEN_IMAGE, SDXL, Z_IMAGE
    from loraswap.server.engine.types import ModelDefaults

    pipe, true_cfg, plain = object(), ModelDefaults(64, 64, 20, 0.0, true_cfg_scale=3.0), ModelDefaults(64, 64, 20, 4.0)
    assert (FLUX.guidance_batch(pipe, true_cfg, 0.0), FLUX.call_batch(pipe, true_cfg, 0.0)) == (2, 1)
    assert (QWEN_IMAGE.guidance_batch(pipe, plain, 4.0), QWEN_IMAGE.call_batch(pipe, plain, 4.0)) == (2, 1)
    assert (SDXL.call_batch(pipe, plain, 4.0), Z_IMAGE.call_batch(pipe, plain, 4.0)) == (2, 2)
    assert Z_IMAGE.call_batch(pipe, plain, 0.0) == 1
