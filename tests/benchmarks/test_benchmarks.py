"""benchmarks/swap.py and benchmarks/serve.py (also its --fuse comparison) run on tiny models and print well-formed
JSON as their last line.

They run as subprocesses, as a user would run them, with tiny arguments; the
figures themselves are not asserted (they are benchmarks), only their shape
and the invariants that must hold on any machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmarks.swap import KINDS, PATHS, STACK_PATHS, factorization, write_lora_file

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"median_s", "min_s", "max_s", "n"}
SWAP_SUMMARY_KEYS = SUMMARY_KEYS | {"cpu_median_s"}
RATIO_KEYS = {
    "diffusers_hotswap_over_loraswap_warm",
    "diffusers_load_unload_over_loraswap_warm",
    "loraswap_warm_over_floor_copy",
    "loraswap_cold_over_floor_read_copy",
    "loraswap_fuse_over_floor",
    "diffusers_fuse_unfuse_over_loraswap_fuse",
    "loraswap_fuse_over_loraswap_warm",
}


def run_benchmark(module: str, *args: str) -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", module, "--threads", "1", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def assert_summary(summary: dict, count: int, keys: set[str] = SUMMARY_KEYS) -> None:
    assert set(summary) == keys
    assert summary["n"] == count
    assert 0 < summary["min_s"] <= summary["median_s"] <= summary["max_s"]
    if "cpu_median_s" in keys:
        assert summary["cpu_median_s"] > 0


def assert_finite_ratios(values: dict) -> None:
    assert all(isinstance(value, float) and math.isfinite(value) and value > 0 for value in values.values()), values


def test_swap_benchmark_prints_every_path_and_ratio(tmp_path):
    report = run_benchmark(
        "benchmarks.swap", "--model", "tiny-sdxl", "--rank", "4", "--mixed-ranks", "2,4", "--repeats", "2",
        "--profile-fuse", "--json-out", str(tmp_path / "swap.json"),
    )  # fmt: skip
    assert report["model"] == "tiny-sdxl" and report["rank"] == 4 and report["torch_threads"] == 1
    assert set(report["paths"]) == set(PATHS) == set(report["first_swap_s"])
    assert {"loraswap_fuse", "floor_fuse"} <= set(PATHS)
    for summary in report["paths"].values():
        assert_summary(summary, 2, SWAP_SUMMARY_KEYS)
    assert set(report["ratios"]) == set(report["ratios_cpu"]) and RATIO_KEYS <= set(report["ratios"])
    assert_finite_ratios(report["ratios"])
    assert_finite_ratios(report["ratios_cpu"])
    shapes = _tiny_sdxl_attention_shapes()
    # 4 attention projections in each of tiny-sdxl's 12 attention modules, rank 4, bf16.
    assert report["adapter_bytes"] == sum(4 * (layer_in + layer_out) * 2 for layer_in, layer_out in shapes)
    # A fused swap reads W0 and writes the weights of those layers; the pristine copies hold their biases too.
    assert report["fused_weight_bytes"] == sum(layer_in * layer_out * 2 for layer_in, layer_out in shapes)
    assert report["pristine_bytes"] > report["fused_weight_bytes"]
    profile = report["fuse_profile"]
    assert profile["swaps"] == 4 and profile["wall_ms_per_swap_profiled"] > 0
    # The merge's product ran under the profiler (one addmm into each weight, or into the float32 block).
    assert {"aten::addmm", "aten::addmm_"} & set(profile["self_cpu_ms_per_swap"])
    assert all(op["ms"] > 0 and op["calls"] > 0 for op in profile["self_cpu_ms_per_swap"].values())
    mixed = report["mixed_rank"]
    assert mixed["ranks"] == [2, 4] and set(mixed["paths"]) == set(PATHS)
    assert set(mixed["by_direction"]) == {"to_r2-a", "to_r4-a"}
    for direction in mixed["by_direction"].values():
        assert set(direction["paths"]) == set(PATHS) and RATIO_KEYS <= set(direction["ratios"])
        assert_finite_ratios(direction["ratios_cpu"])
    # Swaps alternate: of 2 kept swaps one goes each way (the fused paths too, measured round by round).
    for path in ("loraswap_warm", "loraswap_fuse", "floor_fuse"):
        assert_summary(mixed["by_direction"]["to_r2-a"]["paths"][path], 1, SWAP_SUMMARY_KEYS)
    # Two stacks of two rank-2 adapters: each stack holds the bytes of one rank-4 adapter.
    stack = report["stack"]
    assert (stack["members"], stack["member_rank"], stack["summed_rank"]) == (2, 2, 4)
    assert stack["adapter_bytes"] == report["adapter_bytes"]
    assert set(stack["paths"]) == set(STACK_PATHS) == set(stack["first_swap_s"])
    for summary in stack["paths"].values():
        assert_summary(summary, 2, SWAP_SUMMARY_KEYS)
    assert set(stack["ratios"]) == {"loraswap_stack_over_floor_copy_stack", "loraswap_stack_over_loraswap_warm"}
    assert all(isinstance(value, float) and math.isfinite(value) for value in stack["ratios"].values())
    # 4 adapters and 2 stacks, the 4 adapters fused, then the base model, each followed by a compiled run.
    check = report["recompilation_check"]
    assert report["recompilations"] == 0 and check["swaps_checked"] == 11 and check["fused_swaps_checked"] == 4
    _assert_kinds(report)
    assert json.loads((tmp_path / "swap.json").read_text()) == report


def _assert_kinds(report: dict) -> None:
    """Each LyCORIS kind's fused swaps beside the headline LoRA's: LoHa and LoKr on its layers, LoCon on the
    resnets' too; diffusers reads the LoCon file and neither the LoHa nor the LoKr one."""
    kinds = report["kinds"]
    assert set(kinds["paths"]) == {"loraswap_fuse"} | {f"loraswap_fuse_{kind}" for kind in KINDS}
    for path in kinds["paths"].values():
        assert_summary({key: path[key] for key in SWAP_SUMMARY_KEYS}, 2, SWAP_SUMMARY_KEYS)
    paths = kinds["paths"]
    assert paths["loraswap_fuse"]["fused_weight_bytes"] == report["fused_weight_bytes"]
    assert paths["loraswap_fuse_loha"]["fused_weight_bytes"] == paths["loraswap_fuse_lokr"]["fused_weight_bytes"]
    assert paths["loraswap_fuse_loha"]["fused_weight_bytes"] == report["fused_weight_bytes"]
    assert paths["loraswap_fuse_locon"]["fused_weight_bytes"] > report["fused_weight_bytes"]
    assert [paths[f"loraswap_fuse_{kind}"]["adapter_kinds"] for kind in KINDS] == [["loha"], ["lokr"], ["lora"]]
    assert set(kinds["over_lora_per_byte"]) == set(KINDS)
    assert_finite_ratios(kinds["over_lora_per_byte"])
    diffusers = kinds["diffusers"]
    assert not diffusers["loha"]["loads"] and not diffusers["lokr"]["loads"] and diffusers["loha"]["error"]
    if diffusers["locon"]["loads"]:
        assert_summary(
            {key: diffusers["locon"]["diffusers_fuse_unfuse"][key] for key in SWAP_SUMMARY_KEYS}, 2, SWAP_SUMMARY_KEYS
        )


@pytest.mark.parametrize("dimension", [96, 320, 640, 1280, 2048, 2560, 5120, 10240])
def test_the_lokr_files_factor_each_side_as_lycoris_does(dimension: int) -> None:
    from lycoris.functional.general import factorization as lycoris_factorization

    assert factorization(dimension) == tuple(lycoris_factorization(dimension, -1))
    assert factorization(dimension, 8) == tuple(lycoris_factorization(dimension, 8))


def test_serve_benchmark_prints_latency_and_throughput():
    report = run_benchmark(
        "benchmarks.serve", "--model", "tiny-flux", "--steps", "3", "--repeats", "2", "--adapters", "4",
        "--clients", "3", "--mix-requests", "6", "--compile-backend", "none",
    )  # fmt: skip
    assert report["model"] == "tiny-flux" and report["torch_threads"] == 1
    assert_summary(report["time_to_first_progress"], 2)
    per_step = report["per_step"]
    assert_summary(per_step["direct"], 2 * 2)  # 2 timed requests x (3 steps - 1) intervals
    assert_summary(per_step["streamed_client"], 2 * 2)
    assert per_step["streamed_over_direct"] > 0
    change = report["adapter_change"]
    assert_summary(change["change"], 2) and assert_summary(change["keep"], 2)
    assert change["server_swap"]["min_s"] > 0  # every "change" request really swapped
    throughput = report["throughput"]
    assert throughput["requests"] == 6 and throughput["clients"] == 3 and throughput["images_per_s"] > 0
    previews = report["previews"]
    assert_summary(previews["step_without"], 2 * 2)
    assert_summary(previews["step_with_every_step"], 2 * 2)
    assert previews["with_over_without"] > 0 and previews["preview_bytes_median"] > 0
    assert report["recompilations"] == 0


def test_serve_fuse_benchmark_compares_the_policies_on_both_workloads():
    report = run_benchmark(
        "benchmarks.serve", "--fuse", "--fuse-rounds", "1", "--fuse-requests", "3", "--fuse-clients", "1",
        "--switch-steps", "1", "--run-steps", "2", "--run-length", "2", "--compile-backend", "none",
    )  # fmt: skip
    assert report["benchmark"] == "serve_fuse" and report["model"] == "shapes" and report["torch_threads"] == 1
    assert set(report["workloads"]) == {"switching", "runs"}
    for workload in report["workloads"].values():
        assert set(workload["policies"]) == {"never", "always", "auto"}
        for policy, figures in workload["policies"].items():
            assert figures["images"] == 3 and figures["images_per_s"] > 0, (policy, figures)
            assert 0 < figures["latency_s"]["p50"] <= figures["latency_s"]["p99"]
            assert figures["swaps"] == figures["fused_swaps"] + figures["unfused_swaps"]
        never, always = workload["policies"]["never"], workload["policies"]["always"]
        assert never["fused_images"] == 0 and always["fused_images"] == always["images"]
        assert never["swap_ms_median"]["fused"] is None and always["swap_ms_median"]["unfused"] is None
        goals = workload["goals"]
        assert goals["better_fixed_policy"] in {"never", "always"}
        assert_finite_ratios({k: v for k, v in goals.items() if k != "better_fixed_policy"})
    # One client, in order: every request of the switching workload changes adapter.
    switching = report["workloads"]["switching"]
    assert switching["steps"] == 1 and switching["adapter_changes"] == "every request"
    assert all(figures["swaps"] == 3 for figures in switching["policies"].values())
    assert report["workloads"]["runs"]["steps"] == 2
    info = report["server_info"]
    assert {policy: values["fuse"] for policy, values in info.items()} == {p: p for p in ("never", "always", "auto")}
    assert info["never"]["fuse_pristine_bytes"] == 0 < info["always"]["fuse_pristine_bytes"]
    assert info["auto"]["fuse_pristine_bytes"] == info["always"]["fuse_pristine_bytes"]
    assert report["auto_rule"].startswith("--fuse auto: cost model for cpu")
    assert report["recompilations"] == 0


SOAK_KEYS = {
    "completed", "cancelled", "cancelled_queued", "cancelled_running", "deadlined", "failed", "failures", "planned",
    "churn", "recompilations", "base_image_unchanged", "rss_mb", "rss_growth_last_two_thirds_mb",
    "rss_growth_goal_mb", "rss_growth_within_goal", "requests", "wall_s", "timed_out",
}  # fmt: skip


def test_soak_benchmark_accounts_for_every_request():
    report = run_benchmark(
        "benchmarks.soak", "--requests", "12", "--adapters", "3", "--clients", "3", "--steps", "3",
        "--cancel-fraction", "0.4", "--deadline-fraction", "0.2", "--compile-backend", "none",
    )  # fmt: skip
    assert SOAK_KEYS <= set(report) and report["model"] == "shapes" and report["server_torch_threads"] == 1
    assert report["requests"] == 12 and not report["timed_out"]
    assert report["completed"] + report["cancelled"] + report["deadlined"] + report["failed"] == 12
    assert report["cancelled"] == report["cancelled_queued"] + report["cancelled_running"]
    assert report["failed"] == 0, report["failures"]
    assert report["recompilations"] == 0 and report["base_image_unchanged"]
    assert set(report["rss_mb"]) == {"start", "after_third_1", "after_third_2", "after_third_3"}
    assert all(value > 0 for value in report["rss_mb"].values())
    assert report["rss_growth_last_two_thirds_mb"] == pytest.approx(
        report["rss_mb"]["after_third_3"] - report["rss_mb"]["after_third_1"]
    )
    assert report["churn"]["churn_failed"] == 0


def test_lora_files_load_as_the_pipeline_expects(tmp_path):
    """The benchmark's adapters are real diffusers LoRA files: diffusers loads them onto every targeted layer."""
    from loraswap.server.engine.models import builtin_model
    from loraswap.server.engine.pipeline.target_layers import resolve_target_layers

    pipe = builtin_model("tiny-sdxl").build()
    patterns = ("to_q", "to_k", "to_v", "to_out.0")
    layers = resolve_target_layers(pipe.unet, patterns)
    path = write_lora_file(pipe, layers, tmp_path / "r4", rank=4, patterns=patterns, seed=1)
    pipe.load_lora_weights(str(path.parent), adapter_name="bench")
    for name in layers:
        module = pipe.unet.get_submodule(name)
        assert module.lora_A["bench"].weight.shape[0] == 4
        assert torch.count_nonzero(module.lora_B["bench"].weight) > 0


def _tiny_sdxl_attention_shapes() -> list[tuple[int, int]]:
    from loraswap.server.engine.models import builtin_model
    from loraswap.server.engine.pipeline.target_layers import resolve_target_layers

    unet = builtin_model("tiny-sdxl").build().unet
    layers = resolve_target_layers(unet, ("to_q", "to_k", "to_v", "to_out.0"))
    return [(unet.get_submodule(n).in_features, unet.get_submodule(n).out_features) for n in layers]


@pytest.mark.parametrize(
    ("name", "layers", "message"),
    [
        ("random-sdxl", 2, "--layers applies to random-flux, random-qwen-image, random-z-image and random-flux2-klein only"),
        ("random-flux", 0, "use 1 to 19"),
        ("random-flux", 20, "use 1 to 19"),
        ("tiny-flux", 2, "--layers applies to random-flux, random-qwen-image, random-z-image and random-flux2-klein only"),
        ("random-sd15", None, "unknown builtin model"),
    ],
)
def test_random_full_models_refuse_what_they_cannot_build(name, layers, message):
    from loraswap.server.engine.models import builtin_model

    with pytest.raises(ValueError, match=message):
        builtin_model(name).build(layers=layers)


def test_random_flux_has_flux1_layer_shapes_at_reduced_depth():
    from loraswap.server.engine.models.random_full import build_random_flux_transformer

    transformer = build_random_flux_transformer(torch.bfloat16, layers=1)
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (1, 2)
    attention = transformer.transformer_blocks[0].attn
    assert (attention.to_q.in_features, attention.to_q.out_features) == (3072, 3072)
    assert transformer.context_embedder.in_features == 4096  # T5-XXL width
    assert transformer.x_embedder.in_features == 64
    weights = attention.to_q.weight
    assert weights.dtype == torch.bfloat16 and 0.015 < weights.float().std().item() < 0.025


def test_fuse_costs_benchmark_fits_the_constants_from_measured_steps_and_merges():
    report = run_benchmark("benchmarks.fuse_costs", "--models", "tiny-flux", "--rounds", "1", "--steps", "3")
    assert report["benchmark"] == "fuse_costs" and [m["model"] for m in report["models"]] == ["tiny-flux"]
    (model,) = report["models"]
    assert model["lora_work"]["calls"] > 0 and model["lora_work"]["macs_per_pixel"] > 0
    assert [row["bucket"] for row in model["lora"]] == [16, 32, 64]
    assert all(row["merge_ms"] > 0 and row["predicted_ms_code"] > 0 for row in model["merges"])
    assert set(report["fitted"]) == set(report["code"]) == {
        "lora_call_ns", "lora_mac_ns", "merge_layer_ns", "merge_byte_ns", "merge_mac_ns"
    }  # fmt: skip
    assert all(math.isfinite(value) and value >= 0 for value in report["fitted"].values())
