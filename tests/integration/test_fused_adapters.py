"""Fused adapters on real servers: images equal plain diffusers' load_lora_weights + fuse_lora, repeats are bit
for bit after long mixed sequences, nothing recompiles, and what the slot cannot hold is served fused.

One tiny-flux server with --fuse always (compiled: only the base model's graph) over PEFT-written adapters: plain
LoRAs, a DoRA adapter, one that trains lora_B's bias and one of twice the slot's max rank; and a LyCORIS file in
BFL names (sd-scripts' layout for Flux) mixing every kind, whose image must equal a plain diffusers pipeline with
the weights LyCORIS's own modules compute (tests/support/flux_files.py). The runtime tests at the
end mix fused and unfused swaps on compiled runtimes (--compile full and regional) under --fuse auto.
"""

from __future__ import annotations

import dataclasses

import pytest
import pytest_asyncio
import torch

from loraswap.client import LoraswapError
from loraswap.server.engine.adapters.formats import load_canonical
from loraswap.server.engine.adapters.sources import LocalAdapterDirectory
from loraswap.server.engine.config import EngineConfig
from loraswap.server.engine.pipeline.startup import start_runtime
from loraswap.server.engine.types import GenerationRequest
from tests.support.adapters import write_random_adapters
from tests.support.flux_files import BFL_LAYERS, FluxFile
from tests.support.images import MIN_ADAPTER_EFFECT, assert_images_close, decode
from tests.support.servers import TEST_TORCH_THREADS, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_RANK = 16
PROMPT = "a lighthouse at dusk"
SEED = 11
STEPS = 4
GUIDANCE = 3.5
ADAPTERS = {
    "attn": dict(rank=4, alpha=8.0, target_modules=("to_q", "to_k", "to_v", "to_out.0"), seed=1),
    "mlp": dict(rank=16, alpha=16.0, target_modules=("ff.net.0.proj", "ff.net.2", "proj_mlp"), seed=2),
    "dora": dict(rank=4, alpha=4.0, target_modules=("to_q", "to_v", "proj_out", "ff.net.2"), seed=3, use_dora=True),
    "bias": dict(rank=4, alpha=4.0, target_modules=("to_k", "ff.net.2", "proj_mlp"), seed=4, lora_bias=True),
    "wide": dict(rank=2 * MAX_RANK, alpha=32.0, target_modules=("to_q", "to_out.0", "proj_out"), seed=5),
}


# BFL layer -> kind: LoKr on a qkv (cut by rows), LoHa on linear1, DoRA, a full difference, plain LoRA, ...
BFL_KINDS = dict(zip(sorted(BFL_LAYERS), ["lokr", "loha", "dora", "full", "lora", "loha-dora", "lokr-whole"] * 2))


@pytest.fixture(scope="module")
def fused_adapter_dir(tmp_path_factory):
    return write_random_adapters("tiny-flux", tmp_path_factory.mktemp("fused-adapters"), ADAPTERS, init_std=0.5)


@pytest.fixture(scope="module")
def bfl_file(fused_adapter_dir):
    return FluxFile(fused_adapter_dir / "bfl-lycoris.safetensors", "bfl", BFL_KINDS, seed=21)


class FusedReference:
    """Images of a fresh plain-diffusers pipeline with the adapters loaded and fused the standard way."""

    def __init__(self, model_dir, adapter_dir) -> None:
        self.model_dir, self.adapter_dir = model_dir, adapter_dir

    def image(self, members: list[tuple[str, float]]):
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(self.model_dir)
        pipe.set_progress_bar_config(disable=True)
        for name, _ in members:
            pipe.load_lora_weights(str(self.adapter_dir / name), adapter_name=name)
        if len(members) == 1:
            pipe.fuse_lora(lora_scale=members[0][1], adapter_names=[members[0][0]])
        elif members:
            pipe.set_adapters([name for name, _ in members], adapter_weights=[scale for _, scale in members])
            pipe.fuse_lora(adapter_names=[name for name, _ in members])
        pipe.unload_lora_weights()  # the merged weights stay; the LoRA layers go
        return self._run(pipe)

    def merged_image(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """The image with these transformer layers' weights and biases set (module -> (weight, bias))."""
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(self.model_dir)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            for module, (weight, bias) in weights.items():
                layer = pipe.transformer.get_submodule(module)
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
        return self._run(pipe)

    @staticmethod
    def _run(pipe):
        result = pipe(
            prompt=PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, width=64, height=64,
            generator=torch.Generator("cpu").manual_seed(SEED), output_type="pil", max_sequence_length=32,
        )  # fmt: skip
        import numpy as np

        return np.asarray(result.images[0].convert("RGB")).astype(np.int32)


@pytest.fixture(scope="module")
def fused_reference(exported_models, fused_adapter_dir):
    return FusedReference(exported_models["tiny-flux"], fused_adapter_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(fused_adapter_dir, bfl_file):
    async with serving("tiny-flux", fused_adapter_dir, fuse="always") as running:
        yield running


async def image_of(client, members: list[tuple[str, float]]):
    if len(members) == 1:
        ((name, scale),) = members
        return await client.generate_image(
            PROMPT, adapter=name, adapter_scale=scale, seed=SEED, num_inference_steps=STEPS, guidance_scale=GUIDANCE
        )
    return await client.generate_image(
        PROMPT, adapters=members, seed=SEED, num_inference_steps=STEPS, guidance_scale=GUIDANCE
    )


CASES = {
    "plain": [("attn", 1.0)],
    "strength": [("mlp", 0.6)],
    "negative": [("attn", -0.8)],
    "dora": [("dora", 1.0)],
    "dora-strength": [("dora", 0.5)],
    "bias": [("bias", 1.0)],
    "wide": [("wide", 1.0)],
    "stack": [("attn", 0.8), ("mlp", 0.5)],
    "stack-past-max-rank": [("mlp", 1.0), ("wide", 0.7)],
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_fused_image_equals_diffusers_fuse_lora(client, fused_reference, case) -> None:
    members = CASES[case]
    image = await image_of(client, members)
    assert image.fused
    actual = decode(image.data)
    assert_images_close(actual, fused_reference.image(members))
    base = decode((await image_of(client, [])).data)
    assert abs(actual - base).max() >= MIN_ADAPTER_EFFECT, "the adapter must change the image"


@pytest.mark.parametrize("scale", [1.0, 0.7])
async def test_a_bfl_lycoris_file_of_mixed_kinds_equals_its_lycoris_merge(client, fused_reference, bfl_file, scale):
    image = await image_of(client, [("bfl-lycoris", scale)])
    assert image.fused and set(image.changed_components) == {"transformer"}
    actual = decode(image.data)
    assert_images_close(actual, fused_reference.merged_image(bfl_file.merged_weights(scale)))
    base = decode((await image_of(client, [])).data)
    assert abs(actual - base).max() >= MIN_ADAPTER_EFFECT, "the adapter must change the image"
    again = await image_of(client, [("attn", 1.0)])
    assert (await image_of(client, [("bfl-lycoris", scale)])).data == image.data != again.data


async def test_server_info_says_how_swaps_apply_adapters(client) -> None:
    info = await client.server_info()
    assert info.fuse == "always"
    # A copy of every slot layer's base weight: tiny-flux's in float32.
    assert info.fuse_pristine_bytes > 0 and info.fuse_pristine_bytes % 4 == 0


async def test_repeats_are_bit_identical_after_a_long_mixed_sequence_and_nothing_recompiles(client) -> None:
    firsts = {case: (await image_of(client, CASES[case])).data for case in ("plain", "dora", "stack", "wide")}
    base = (await image_of(client, [])).data
    before = (await client.server_info()).recompilations
    for _ in range(2):
        for case in ("bias", "stack", "plain", "dora-strength", "wide", "stack-past-max-rank", "negative", "dora"):
            await image_of(client, CASES[case])
        assert (await image_of(client, [])).data == base
    for case, data in firsts.items():
        assert (await image_of(client, CASES[case])).data == data, case
    assert (await client.server_info()).recompilations == before == 0


async def test_a_refused_request_leaves_the_fused_weights_untouched(client) -> None:
    resident = await image_of(client, CASES["dora"])
    for bad in ({"adapter": "no-such-adapter"}, {"adapter": "dora", "adapter_scale": float("nan")},
                {"adapters": [("dora", 1.0), ("dora", 0.5)]}):  # fmt: skip
        with pytest.raises(LoraswapError):
            await client.generate_image(PROMPT, seed=SEED, num_inference_steps=STEPS, **bad)
    again = await image_of(client, CASES["dora"])
    assert again.data == resident.data and again.timings.adapter_swap_ms == 0.0  # still resident: no swap


@pytest.mark.asyncio(loop_scope="session")
async def test_on_a_compiled_server_an_unfused_pin_without_a_compiled_graph_is_refused(client) -> None:
    """This --fuse always server compiled the base model's graph only: an unfused pin would compile mid-queue, so
    it is refused, changing nothing; the fused pin is the policy's own path."""
    resident = await image_of(client, CASES["plain"])
    with pytest.raises(LoraswapError) as refused:
        await client.generate_image(PROMPT, adapter="attn", seed=SEED, num_inference_steps=STEPS,
                                    guidance_scale=GUIDANCE, fuse="unfused")  # fmt: skip
    assert refused.value.code.name == "FAILED_PRECONDITION" and refused.value.reason == "FUSE_CHOICE_UNAVAILABLE"
    assert "compiled no graph" in str(refused.value)
    pinned = await client.generate_image(PROMPT, adapter="attn", seed=SEED, num_inference_steps=STEPS,
                                         guidance_scale=GUIDANCE, fuse="fused")  # fmt: skip
    assert pinned.fused and pinned.data == resident.data and pinned.timings.adapter_swap_ms == 0.0


# -- fused and unfused on one compiled runtime -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "regional"])
def test_fused_and_unfused_swaps_in_any_order_compile_nothing_and_keep_every_address(
    fused_adapter_dir, kind, monkeypatch
):
    """A compiled auto runtime serves both paths from the graphs its rule compiled: here merges are costed so dear
    that the rule may choose every bucket unfused, so the warm-up compiles them all beside the base model's."""
    from loraswap.server.engine import fuse_policy

    dear_merges = dataclasses.replace(fuse_policy.DEVICE_COSTS["cpu"], merge_layer_ns=1e9)
    monkeypatch.setitem(fuse_policy.DEVICE_COSTS, "cpu", dear_merges)
    runtime = start_runtime(
        EngineConfig(model="tiny-flux", max_rank=MAX_RANK, compile=kind, compile_backend="eager", fuse="auto",
                     torch_threads=TEST_TORCH_THREADS)
    )  # fmt: skip
    assert runtime.warmed.unfused_buckets == frozenset(runtime.residency.slot.rank_buckets)
    directory = LocalAdapterDirectory(fused_adapter_dir)
    adapters = {name: load_canonical(directory.find(name), runtime.slot_spec()) for name in ADAPTERS}
    params = runtime.request_rules.resolve(GenerationRequest(prompt=PROMPT, seed=SEED, num_inference_steps=2))
    addresses = {
        name: (layer.weight.data_ptr(), layer.bias.data_ptr() if layer.bias is not None else None)
        for name, layer in runtime.residency.slot.base_layers().items()
    }

    def image(stack, fused):
        return runtime.generate(params, stack, on_step=lambda _: None, is_cancelled=lambda: False, fused=fused).data

    attn, mlp = ((adapters["attn"], 1.0),), ((adapters["mlp"], 0.7),)
    stack = ((adapters["attn"], 0.5), (adapters["mlp"], 1.0))
    first = {("attn", True): image(attn, True), ("attn", False): image(attn, False), ("base", False): image((), False)}
    sequence = [(mlp, True), (stack, False), (((adapters["dora"], 1.0),), True), (attn, False), ((), False),
                (stack, True), (((adapters["wide"], 1.0),), True), (mlp, False), (attn, True)]  # fmt: skip
    for members, fused in sequence:
        image(members, fused)
    assert image(attn, True) == first[("attn", True)]
    assert image(attn, False) == first[("attn", False)]
    assert image((), False) == first[("base", False)]
    assert runtime.recompilations == 0
    after = {
        name: (layer.weight.data_ptr(), layer.bias.data_ptr() if layer.bias is not None else None)
        for name, layer in runtime.residency.slot.base_layers().items()
    }
    assert after == addresses
