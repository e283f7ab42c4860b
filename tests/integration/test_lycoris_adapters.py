"""LyCORIS files served by a real compiled tiny-sdxl server: images equal the LyCORIS network's own on plain
diffusers, text-encoder layers included, nothing recompiles and the base model comes back bit for bit.

The files (LoHa, LoKr, LoCon with Tucker cores, full, DoRA, and a slot-sized LoRA with text-encoder layers) are
written by the LyCORIS package's kohya network (tests/support/lycoris_files.py); the server fuses every one of them
(--fuse always; the slot-sized LoRA's text-encoder layers are merged into the text encoders either way).
"""

from __future__ import annotations

import pytest
import pytest_asyncio

from tests.support.images import MIN_ADAPTER_EFFECT, assert_images_close, decode
from tests.support.lycoris_files import (
    KINDS,
    TEST_PRESET,
    UNSUPPORTED_KINDS,
    assert_ia3_refused_and_serving_on,
    write_lycoris_file,
)
from tests.support.reference import LycorisReference
from tests.support.servers import serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a lighthouse at dusk"
SEED = 5
STEPS = 3
GUIDANCE = 5.0
SERVED = ("loha", "loha-tucker", "lokr", "lokr-whole", "locon-tucker", "full", "dora", "loha-dora")
# A plain LoRA of the attention layers (the slot's) with text-encoder layers.
ATTENTION_PRESET = dict(TEST_PRESET, unet_target_module=["Transformer2DModel"], unet_target_name=[])


@pytest.fixture(scope="module")
def lycoris_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lycoris-served")
    for seed, name in enumerate(SERVED, start=1):
        write_lycoris_file(directory / f"{name}.safetensors", KINDS[name], seed=seed)
    write_lycoris_file(directory / "ia3.safetensors", UNSUPPORTED_KINDS["ia3"], seed=20)
    write_lycoris_file(directory / "slot-lora.safetensors", dict(algo="lora"), seed=21, preset=ATTENTION_PRESET)
    return directory


@pytest.fixture(scope="module")
def reference(exported_models, lycoris_dir):
    return LycorisReference(exported_models["tiny-sdxl"], "sdxl", lycoris_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(lycoris_dir):
    async with serving("tiny-sdxl", lycoris_dir, fuse="always") as running:
        yield running


async def _image(client, members):
    return await client.generate_image(
        PROMPT, adapters=members, seed=SEED, num_inference_steps=STEPS, guidance_scale=GUIDANCE
    )


def _expected(reference, name: str, scale: float, **options):
    preset = ATTENTION_PRESET if name == "slot-lora" else None
    return reference.lycoris_image(
        name, scale, prompt=PROMPT, seed=SEED, steps=STEPS, guidance=GUIDANCE, preset=preset, **options
    )


CASES = [(name, 1.0) for name in SERVED] + [("loha", 0.6), ("lokr", -0.7), ("dora", 0.5), ("slot-lora", 1.0)]


@pytest.mark.parametrize(("name", "scale"), CASES)
async def test_an_image_equals_the_lycoris_networks_own(client, reference, name, scale) -> None:
    image = await _image(client, [(name, scale)])
    assert image.fused and image.changed_components == ("text_encoder", "text_encoder_2", "unet")
    actual = decode(image.data)
    assert_images_close(actual, _expected(reference, name, scale))
    base = decode((await _image(client, [])).data)
    assert abs(actual - base).max() >= MIN_ADAPTER_EFFECT, "the adapter must change the image"


async def test_text_encoder_layers_are_applied_not_dropped(client, reference) -> None:
    actual = decode((await _image(client, [("slot-lora", 1.0)])).data)
    without = _expected(reference, "slot-lora", 1.0, text_encoders=False)
    assert abs(actual - without).max() >= MIN_ADAPTER_EFFECT, "the text-encoder layers must change the image"


async def test_the_listing_says_kinds_components_and_fusing(client) -> None:
    loha = (await client.preload_adapter("loha")).adapter
    assert loha.kinds == ("loha",) and loha.must_fuse and loha.warnings == ()
    assert set(loha.component_layers) == {"unet", "text_encoder", "text_encoder_2"}
    assert len(loha.target_layers) == loha.component_layers["unet"]
    assert any("resnets" in layer and layer.endswith("conv1") for layer in loha.target_layers)
    slot_lora = (await client.preload_adapter("slot-lora")).adapter
    assert slot_lora.kinds == ("lora",) and not slot_lora.must_fuse


async def test_mixed_stacks_repeats_and_the_base_model_are_bit_identical_and_nothing_recompiles(client) -> None:
    stack = [("loha", 0.6), ("locon-tucker", 0.5), ("slot-lora", 0.8)]
    firsts = {"stack": (await _image(client, stack)).data, "lokr": (await _image(client, [("lokr", 1.0)])).data}
    base = (await _image(client, [])).data
    for members in ([("full", 1.0)], stack[:2], [("dora", 0.5)], [], [("loha-dora", 1.0)], stack):
        await _image(client, members)
    assert (await _image(client, [])).data == base
    assert (await _image(client, stack)).data == firsts["stack"]
    assert (await _image(client, [("lokr", 1.0)])).data == firsts["lokr"]
    alone = (await _image(client, stack[:1])).data
    assert alone != firsts["stack"]
    assert (await client.server_info()).recompilations == 0


async def test_an_unsupported_kind_is_refused_naming_it_and_the_server_serves_on(client) -> None:
    await assert_ia3_refused_and_serving_on(lambda members: _image(client, members))
