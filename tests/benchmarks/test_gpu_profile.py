"""benchmarks/gpu_profile.py: the profile summary of the GPU check, on synthetic kernels and on a real CPU profile.

The kernel names are those an H100/H200 profile shows (cuBLAS's nvjet and sm90 xmma GEMMs, cuDNN's SDPA, FA3,
inductor's triton kernels); the check's figures are only as good as this classification.
"""

from __future__ import annotations

import types

import pytest
import torch
from benchmarks.gpu_profile import (
    KINDS,
    STEP_END,
    SWAP_BEGINS,
    SWAP_DONE,
    KernelRecord,
    kind_of,
    records_from_profile,
    summarise,
)

PROJECTION = [[4096, 3072], [3072, 3072]]
LORA_A = [[4096, 3072], [3072, 64]]
LORA_B = [[4096, 64], [64, 12288]]


@pytest.mark.parametrize(
    ("record", "rank", "kind"),
    [
        (KernelRecord("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0, 1, PROJECTION, "aten::mm"), 64, "gemm"),
        (KernelRecord("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 0, 1, LORA_A, "aten::mm"), 64, "lora_factors"),
        (KernelRecord("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 0, 1, LORA_B, "aten::addmm"), 64, "lora_factors"),
        (KernelRecord("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 0, 1, LORA_B, "aten::addmm"), None, "gemm"),
        (KernelRecord("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8", 0, 1), None, "gemm"),
        (KernelRecord("triton_tem_fused_mm_0", 0, 1, PROJECTION, "triton_tem_fused_mm_0"), 64, "gemm"),
        # A convolution's 64 output channels are no rank: convolutions are implicit GEMMs, never LoRA factors.
        (KernelRecord("aten::conv2d", 0, 1, [[1, 16, 8, 8], [64, 16, 3, 3]], "aten::conv2d"), 64, "gemm"),
        (KernelRecord("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", 0, 1), 64, "gemm"),
        (KernelRecord("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", 0, 1), 64,
         "attention"),
        (KernelRecord("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 0, 1), 64, "attention"),
        (KernelRecord("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 0, 1, [], "aten::_efficient_attention_forward"),
         64, "attention"),
        (KernelRecord("aten::_scaled_dot_product_flash_attention_for_cpu", 0, 1, [[1, 24, 4608, 64]],
                      "aten::_scaled_dot_product_flash_attention_for_cpu"), 64, "attention"),
        (KernelRecord("triton_poi_fused_add_mul_0", 0, 1, [], "triton_poi_fused_add_mul_0"), 64, "elementwise"),
        (KernelRecord("triton_red_fused_native_layer_norm_1", 0, 1), 64, "elementwise"),
        (KernelRecord("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
                      0, 1, [[1, 64]], "aten::add"), 64, "elementwise"),
        (KernelRecord("aten::mul", 0, 1, [[4096, 64], []], "aten::mul"), 64, "elementwise"),
        (KernelRecord("Memcpy HtoD (Pinned -> Device)", 0, 1, [[64, 3072]], "aten::copy_"), 64, "other"),
        (KernelRecord("Memset (Device)", 0, 1), 64, "other"),
        (KernelRecord("some_kernel_of_a_library", 0, 1), 64, "other"),
    ],
)  # fmt: skip
def test_each_kernel_is_classified_by_its_name_and_its_ops_shapes(record, rank, kind) -> None:
    assert kind_of(record, rank=rank) == kind


def test_a_kernel_launched_inside_the_swap_is_the_merge_whatever_it_is() -> None:
    gemm = KernelRecord("sm90_xmma_gemm_bf16bf16_bf16f32", 10, 20, LORA_B, "aten::addmm", launched=5)
    elementwise = KernelRecord("triton_poi_fused_add_0", 20, 30, [], "", launched=6)
    after = KernelRecord("sm90_xmma_gemm_bf16bf16_bf16f32", 40, 50, PROJECTION, "aten::mm", launched=9)
    summary = summarise([gemm, elementwise, after], rank=64, swap=(4.0, 7.0))
    assert summary["kernel_count"]["merge"] == 2 and summary["kernel_count"]["gemm"] == 1
    assert summary["kernel_ms"]["merge"] == pytest.approx(0.020)


def test_kernel_time_by_kind_names_every_kind_and_the_busy_time_is_a_union() -> None:
    # Plain (name, start, end, shapes) tuples are records too; times in microseconds.
    summary = summarise([("sm90_xmma_gemm", 0.0, 1000.0, []), ("flash_fwd", 500.0, 2000.0, [])])
    assert set(summary["kernel_ms"]) == set(KINDS) == set(summary["kernel_count"])
    assert summary["kernel_ms"]["gemm"] == 1.0 and summary["kernel_ms"]["attention"] == 1.5
    assert summary["kernel_ms"]["other"] == 0.0 and summary["busy_ms"] == 2.0
    assert summary["attention_kernels"] == ["flash_fwd"]
    assert [entry["name"] for entry in summary["top_kernels"]] == ["flash_fwd", "sm90_xmma_gemm"]
    # No step marks: no step figures, rather than made-up ones.
    assert summary["steps_measured"] == 0 and summary["idle_ms_per_step"] is None and summary["step_ms"] is None


def test_idle_time_per_step_is_the_steps_span_less_its_kernels() -> None:
    step_ends = [100.0, 200.0, 300.0]  # host times of the step callback
    kernels = [
        KernelRecord("gemm_prompt", 0.0, 500.0, launched=50.0),  # before the first mark: the first step, unmarked
        KernelRecord("gemm_a", 1000.0, 2000.0, launched=150.0),  # step 2
        KernelRecord("gemm_b", 3000.0, 5000.0, launched=160.0),  # step 2: 2 ms idle before it and after it
        KernelRecord("gemm_c", 6000.0, 7000.0, launched=250.0),  # step 3
        KernelRecord("gemm_d", 7000.0, 9000.0, launched=260.0),  # step 3: no gap
        KernelRecord("vae_conv", 12000.0, 13000.0, launched=400.0),  # after the last mark: the decode
    ]
    summary = summarise(kernels, step_ends=step_ends)
    # Step 2 spans 1000..6000 µs with 3000 µs of kernels; step 3 spans 6000..9000 µs, all busy.
    assert summary["steps_measured"] == 2
    assert summary["step_ms"] == 4.0 and summary["idle_ms_per_step"] == 1.0
    assert summary["idle_share"] == pytest.approx(2000 / 8000)


def test_overlapping_kernels_of_one_step_are_counted_once() -> None:
    kernels = [
        KernelRecord("gemm_a", 0.0, 4000.0, launched=150.0),
        KernelRecord("gemm_b", 1000.0, 3000.0, launched=160.0),  # on another stream, inside gemm_a
        KernelRecord("gemm_c", 5000.0, 6000.0, launched=170.0),
    ]
    summary = summarise(kernels, step_ends=[100.0, 200.0])
    assert summary["step_ms"] == 6.0 and summary["idle_ms_per_step"] == 1.0


def test_a_cpu_profile_becomes_outer_op_records_and_marks() -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    x, weight = torch.randn(32, 48), torch.randn(8, 48)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(SWAP_BEGINS):
            pass
        with record_function(SWAP_DONE):
            pass
        for _ in range(3):
            torch.nn.functional.linear(x, weight).relu()
            with record_function(STEP_END):
                pass
    records, marks = records_from_profile(prof, device_type="cpu")
    assert len(marks[STEP_END]) == 3 and len(marks[SWAP_BEGINS]) == len(marks[SWAP_DONE]) == 1
    assert marks[STEP_END] == sorted(marks[STEP_END]) and marks[SWAP_DONE][0] < marks[STEP_END][0]
    names = {record.op for record in records}
    # The outermost ops only: aten::linear holds aten::matmul and aten::mm, which are not records themselves.
    assert names == {"aten::linear", "aten::relu"}
    linear = next(record for record in records if record.op == "aten::linear")
    assert [list(shape) for shape in linear.shapes[:2]] == [[32, 48], [8, 48]] and linear.end >= linear.start
    summary = summarise(records, rank=8, swap=(marks[SWAP_BEGINS][0], marks[SWAP_DONE][0]), step_ends=marks[STEP_END])
    assert summary["kernel_count"]["lora_factors"] == 3 and summary["steps_measured"] == 2


class _Event:
    """A profiler event as torch's _KinetoEvent answers (times in ns)."""

    def __init__(self, name, device, start, end, correlation, linked=0, shapes=(), activity="kernel") -> None:
        self._values = (name, device, start, end, correlation, linked, shapes, activity)

    def name(self):
        return self._values[0]

    def device_type(self):
        return f"DeviceType.{self._values[1]}"

    def start_ns(self):
        return self._values[2]

    def end_ns(self):
        return self._values[3]

    def correlation_id(self):
        return self._values[4]

    def linked_correlation_id(self):
        return self._values[5]

    def shapes(self):
        return [list(shape) for shape in self._values[6]]

    def activity_type(self):
        return self._values[7]

    def start_thread_id(self):
        return 1


def test_a_cuda_profile_links_each_kernel_to_the_op_and_the_launch_that_made_it() -> None:
    events = [
        _Event(STEP_END, "CPU", 1_000_000, 1_001_000, 1, activity="user_annotation"),
        _Event("aten::mm", "CPU", 1_100_000, 1_200_000, 7, shapes=LORA_A, activity="cpu_op"),
        _Event("cudaLaunchKernel", "CPU", 1_150_000, 1_160_000, 501, linked=7, activity="cuda_runtime"),
        _Event("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "CUDA", 5_000_000, 5_400_000, 501, linked=7),
        # A triton kernel launched through the driver outside any op: its launch call still places it.
        _Event("cuLaunchKernel", "CPU", 1_300_000, 1_310_000, 502, activity="cuda_driver"),
        _Event("triton_poi_fused_add_0", "CUDA", 5_500_000, 5_600_000, 502),
        # The device's copy of a record_function range, spanning the kernels: no kernel itself, and no mark.
        _Event(STEP_END, "CUDA", 4_900_000, 6_000_000, 0, activity="gpu_user_annotation"),
        # A copy with no launch call the profile kept: counted, but placed in no step.
        _Event("Memcpy DtoH (Device -> Pinned)", "CUDA", 5_700_000, 5_800_000, 503, activity="gpu_memcpy"),
        _Event(STEP_END, "CPU", 2_000_000, 2_001_000, 2, activity="user_annotation"),
    ]
    results = types.SimpleNamespace(events=lambda: events)
    records, marks = records_from_profile(
        types.SimpleNamespace(profiler=types.SimpleNamespace(kineto_results=results)), device_type="cuda"
    )
    assert marks[STEP_END] == [1000.0, 2000.0] and not marks[SWAP_BEGINS]
    lora, pointwise, copy = sorted(records, key=lambda record: record.start)
    assert lora == KernelRecord(
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 5000.0, 5400.0, tuple(map(tuple, LORA_A)), "aten::mm", launched=1150.0
    )
    assert (pointwise.op, pointwise.launched) == ("", 1300.0) and copy.launched is None
    summary = summarise(records, rank=64, step_ends=marks[STEP_END])
    assert summary["kernel_count"] == {
        "gemm": 0, "attention": 0, "lora_factors": 1, "merge": 0, "elementwise": 1, "other": 1
    }  # fmt: skip
    # The step launched the GEMM and the triton kernel: 5000..5600 µs, 100 µs of it idle.
    assert summary["steps_measured"] == 1 and summary["step_ms"] == 0.6 and summary["idle_ms_per_step"] == 0.1
