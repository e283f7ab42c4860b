"""Qwen-Image, Z-Image and FLUX.2 served like FLUX.1: each family's tiny model through a real compiled server.

For each family: PEFT-written adapters (the diffusers layout) at two strengths and as a stack, unfused and fused,
equal plain diffusers' own `load_lora_weights` (and `set_adapters`) on the same exported folder; a LoHa (a kohya-style
LyCORIS file, which diffusers does not read for these families) equals its dense change merged by hand; a file for
another family is refused and changes nothing; repeats are bit-identical; and nothing compiles after start-up.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

from loraswap.client import LoraswapError
from loraswap.server.devtools.random_adapter import write_random_adapter
from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import builtin_model
from tests.support.family_cases import MODELS, FamilyModel
from tests.support.images import assert_images_close, decode
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a red kite over the sea"
STEPS = 2
LOHA_RANK, LOHA_ALPHA = 2, 1.0
# Factors large enough to change the tiny models' images clearly at strength 1.
ADAPTER_STD = 1.0


def _first_layer(denoiser: torch.nn.Module, suffix: str) -> str:
    return next(
        name for name, module in denoiser.named_modules()
        if isinstance(module, torch.nn.Linear) and name.endswith(suffix)
    )  # fmt: skip


def _is_feed_forward(suffix: str) -> bool:
    return any(part in suffix for part in ("mlp", "ff.", "feed_forward"))


def _loha_factors(shape: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = shape

    def draw(*size):
        return torch.randn(*size, generator=generator) * 0.3

    return {
        "hada_w1_a": draw(out_features, LOHA_RANK), "hada_w1_b": draw(LOHA_RANK, in_features),
        "hada_w2_a": draw(out_features, LOHA_RANK), "hada_w2_b": draw(LOHA_RANK, in_features),
    }  # fmt: skip


def _loha_delta(factors: dict[str, torch.Tensor]) -> torch.Tensor:
    """LyCORIS's LoHa: ΔW = (w1_a @ w1_b) ⊙ (w2_a @ w2_b) · alpha / rank."""
    return (
        (factors["hada_w1_a"] @ factors["hada_w1_b"])
        * (factors["hada_w2_a"] @ factors["hada_w2_b"])
        * (LOHA_ALPHA / LOHA_RANK)
    )


def _with_text_encoder_layers(adapter: Path, directory: Path) -> None:
    """The adapter's file with LoRA factors for a text encoder beside its transformer's, as some trainers write."""
    tensors = load_file(adapter / "pytorch_lora_weights.safetensors")
    tensors["text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.randn(4, 32)
    tensors["text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.randn(32, 4)
    directory.mkdir()
    save_file(tensors, directory / "pytorch_lora_weights.safetensors")


class FamilyCase(FamilyModel):
    """One family's tiny model with its adapters: PEFT-written ones, a LoHa, one with text-encoder layers and an
    SDXL one."""

    def __init__(self, model: str, root: Path) -> None:
        super().__init__(model, root)
        self.loha_layer = _first_layer(self.denoiser, "to_k")
        weight = self.denoiser.get_submodule(self.loha_layer).weight
        self.loha = _loha_factors(tuple(weight.shape), seed=3)
        flat = "lycoris_" + self.loha_layer.replace(".", "_")
        tensors = {f"{flat}.{name}": value for name, value in self.loha.items()}
        tensors[f"{flat}.alpha"] = torch.tensor(LOHA_ALPHA)
        save_file(tensors, self.adapters / "loha.safetensors")
        # The LoHa's layer is read first: PEFT leaves its wrappers in the modules it wrote adapters from.
        write_random_adapter(self.pipe, self.adapters / "attn", rank=4, seed=1, init_std=ADAPTER_STD)
        feed_forward = [name for name in family_of(self.pipe).default_target_modules if _is_feed_forward(name)]
        write_random_adapter(
            self.pipe, self.adapters / "mlp", rank=2, seed=2, init_std=ADAPTER_STD, target_modules=feed_forward
        )
        _with_text_encoder_layers(self.adapters / "attn", self.adapters / "attn-with-te")
        # An SDXL LoRA: a file for another family, refused where it is read.
        write_random_adapter(builtin_model("tiny-sdxl").build(), self.adapters / "sdxl", rank=4, seed=4)

    def loha_image(self, scale: float, seed: int, guidance: float) -> np.ndarray:
        """The LoHa's dense change added by hand to plain diffusers' weights."""
        deltas = {self.loha_layer: scale * _loha_delta(self.loha)}
        size = {"width": self.defaults.width, "height": self.defaults.height}
        return self.reference.merged_image(deltas, prompt=PROMPT, seed=seed, steps=STEPS, guidance=guidance, **size)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory) -> FamilyCase:
    return FamilyCase(request.param, tmp_path_factory.mktemp(request.param))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(case):
    # Uncompiled, so that each request may pin either way in (a compiled server warms up only what --fuse runs);
    # test_nothing_compiles_after_start_up serves the same kinds of request compiled.
    async with (
        serving(case.model, case.adapters, max_rank=8, fuse="auto", compile=False) as running,
        client_of(running) as client,
    ):
        yield client


async def _image(client, **options) -> np.ndarray:
    result = await client.generate_image(PROMPT, seed=7, num_inference_steps=STEPS, **options)
    return decode(result.data)


async def test_the_family_is_named_and_the_base_model_repeats_bit_for_bit(client, case):
    info = await client.server_info()
    assert (info.model, info.family) == (case.model, case.family)
    first = await client.generate_image(PROMPT, seed=7, num_inference_steps=STEPS)
    again = await client.generate_image(PROMPT, seed=7, num_inference_steps=STEPS)
    assert first.data == again.data
    guidance = info.default_guidance_scale
    assert_images_close(decode(first.data), case.reference.image("", 1.0, prompt=PROMPT, seed=7, steps=STEPS,
                                                                  guidance=guidance))  # fmt: skip


@pytest.mark.parametrize("fuse", ["unfused", "fused"])
async def test_an_adapter_at_two_strengths_equals_diffusers_own_loading(client, case, fuse):
    guidance = (await client.server_info()).default_guidance_scale
    base = await _image(client)
    for scale in (0.5, 1.0):
        result = await client.generate_image(
            PROMPT, seed=7, num_inference_steps=STEPS, adapter="attn", adapter_scale=scale, fuse=fuse
        )
        assert result.fused == (fuse == "fused")
        image = decode(result.data)
        expected = case.reference.image("attn", scale, prompt=PROMPT, seed=7, steps=STEPS, guidance=guidance)
        assert_images_close(image, expected)
    assert np.abs(image - base).max() > 8  # the adapter really acts


async def test_a_stack_equals_diffusers_set_adapters(client, case):
    guidance = (await client.server_info()).default_guidance_scale
    members = [("attn", 0.8), ("mlp", 0.6)]
    result = await client.generate_image(PROMPT, adapters=members, seed=7, num_inference_steps=STEPS)
    expected = case.reference.stack_image(members, prompt=PROMPT, seed=7, steps=STEPS, guidance=guidance)
    assert_images_close(decode(result.data), expected)


async def test_a_loha_equals_its_dense_change_merged_by_hand(client, case):
    guidance = (await client.server_info()).default_guidance_scale
    for scale in (1.0, 0.5):
        image = await _image(client, adapter="loha", adapter_scale=scale)
        assert_images_close(image, case.loha_image(scale, seed=7, guidance=guidance))


async def test_a_file_for_another_family_is_refused_and_changes_nothing(client, case):
    before = await _image(client, adapter="attn")
    with pytest.raises(LoraswapError) as caught:
        await _image(client, adapter="sdxl")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "ADAPTER_NO_DENOISER_LAYERS"
    assert np.array_equal(await _image(client, adapter="attn"), before)
    assert "sdxl" not in {adapter.id for adapter in (await client.list_adapters()).adapters}


async def test_text_encoder_layers_these_families_cannot_apply_are_refused_by_name(client, case):
    # diffusers loads no text-encoder LoRA for these families: a file with text-encoder layers is refused naming
    # them (the reason such layers have for any family that takes none), and changes nothing.
    before = await _image(client, adapter="attn")
    with pytest.raises(LoraswapError) as caught:
        await _image(client, adapter="attn-with-te")
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_UNSUPPORTED_TENSORS")
    assert "text_encoder (2 tensors)" in caught.value.message
    assert np.array_equal(await _image(client, adapter="attn"), before)


# Z-Image compiled whole (not its default: FamilyTraits.compile_kind) takes a minute to start here: `make test-heavy`.
COMPILED = [
    pytest.param(model, mode, marks=[pytest.mark.heavy] if (model, mode) == ("tiny-z-image", "full") else [])
    for model in MODELS for mode in ("full", "regional")
]  # fmt: skip


@pytest.mark.parametrize(("case", "compile_mode"), COMPILED, indirect=["case"])
async def test_nothing_compiles_after_start_up(case, compile_mode):
    # Compiled (TEST_COMPILE_BACKEND; the whole transformer, or its repeated blocks) under --fuse auto: adapters, a
    # stack, a LoHa, another size and prompts of other lengths (Qwen-Image's and Z-Image's text is as long as the
    # prompt), each repeated bit for bit. Z-Image's full start takes a minute here: its warm-up compiles a graph for
    # each guidance batch, size class and prompt length.
    async with (
        serving(case.model, case.adapters, max_rank=8, fuse="auto", compile=compile_mode) as running,
        client_of(running) as client,
    ):
        size = case.defaults.width + 2 * (await client.server_info()).size_multiple
        requests = [
            {}, {"adapter": "attn"}, {"adapters": [("attn", 0.8), ("mlp", 0.6)]}, {"adapter": "loha"},
            {"adapter": "mlp", "width": size}, {"adapter": "attn", "prompt": "a kite " * 40}, {"prompt": "x"},
        ]  # fmt: skip
        # Guidance with negative prompts of two lengths (Qwen-Image's and Z-Image's CFG reads them; FLUX.2 ignores
        # them). Z-Image compiled whole branches on its texts' lengths, which is why it compiles regionally by default
        # (FamilyTraits.compile_kind): whole, it is held to the other requests only.
        if (case.family, compile_mode) != ("z-image", "full"):
            requests += [{"guidance_scale": 5.0, "negative_prompt": "blurry"},
                         {"guidance_scale": 5.0, "negative_prompt": "grainy, washed out, low contrast " * 4}]  # fmt: skip
        for options in requests:
            prompt = options.pop("prompt", PROMPT)
            first = await client.generate_image(prompt, seed=5, num_inference_steps=STEPS, **options)
            again = await client.generate_image(prompt, seed=5, num_inference_steps=STEPS, **options)
            assert first.data == again.data, options
        assert (await client.server_info()).recompilations == 0
