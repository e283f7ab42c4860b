"""LyCORIS files for Qwen-Image, Z-Image and FLUX.2 (dev and klein), served like SDXL's (test_lycoris_adapters.py):
each family's tiny model through one real uncompiled server that fuses every file.

The files are written by the LyCORIS package's general network on each family's transformer (`lycoris_<module
path>` names, as SimpleTuner and LyCORIS's own scripts save them; tests/support/lycoris_files.py), one per kind that
applies to linear layers: LoRA, LoHa, LoKr (a factored and a whole second factor), full, DoRA and LoHa with DoRA. The
transformers hold no conv, so the Tucker kinds (LoHa's and LoCon's cores) do not arise. Each image equals the LyCORIS
network's own forward on plain diffusers' pipeline from the model's exported folder, and an IA³ file is refused with
SDXL's code, reason and kind name, changing nothing. Z-Image's layers keyed by patch size (`all_x_embedder.2-1`,
whose flattened name keeps the '-') are served too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from tests.support.family_cases import MODELS, FamilyModel
from tests.support.images import MIN_ADAPTER_EFFECT, assert_images_close, decode
from tests.support.lycoris_files import (
    TRANSFORMER_KINDS,
    TRANSFORMER_PRESETS,
    UNSUPPORTED_KINDS,
    applied_transformer_network,
    assert_ia3_refused_and_serving_on,
    write_transformer_lycoris_file,
)
from tests.support.reference import LycorisReference
from tests.support.servers import serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a windmill in a tulip field"
SEED, STEPS = 11, 2
# Every file's factors N(0, STD) at rank RANK with ALPHA (not RANK, so that a reader ignoring alpha would show):
# large enough to change the tiny models' images clearly at strength 1.
RANK, ALPHA, STD = 4, 2.0, 0.6
# Each kind at strength 1, and LoKr (whose alpha LyCORIS's own merge scales twice) at another.
CASES = [(name, 1.0) for name in TRANSFORMER_KINDS] + [("lokr", -0.7)]
# How the listing names each file's kind, where not as the file is named.
LISTED_KIND = {"lokr-whole": "lokr", "dora": "lora+dora", "loha-dora": "loha+dora"}
# Z-Image's layers keyed by patch size in a ModuleDict (`all_x_embedder.2-1`, `all_final_layer.2-1.*`), which
# LyCORIS's "full" preset reaches through FinalLayer: a LoHa of them alone, so that the other files stay servable.
PATCH_LAYERS = "patch-layers"
Z_IMAGE_PATCH_PRESET = dict(target_module=["FinalLayer"], target_name=["all_x_embedder.2-1"])


class LycorisCase(FamilyModel):
    """One family's tiny model with a LyCORIS file of each kind (and an IA³ one) and their reference."""

    def __init__(self, model: str, root: Path) -> None:
        super().__init__(model, root)
        preset = TRANSFORMER_PRESETS[self.family]
        files = {name: (kind, preset) for name, kind in TRANSFORMER_KINDS.items()}
        files["ia3"] = (UNSUPPORTED_KINDS["ia3"], preset)
        if self.family == "z-image":
            files[PATCH_LAYERS] = (TRANSFORMER_KINDS["loha"], Z_IMAGE_PATCH_PRESET)
        for seed, (name, (kind, layers)) in enumerate(files.items(), start=1):
            path = self.adapters / f"{name}.safetensors"
            write_transformer_lycoris_file(path, self.denoiser, kind, layers, seed=seed, std=STD, rank=RANK,
                                           alpha=ALPHA)  # fmt: skip
        self.lycoris = LycorisReference(self.folder, self.family, self.adapters, self.defaults.max_sequence_length)
        # The module paths the network wraps, as the server must find them from the file's flattened names.
        network = applied_transformer_network(self.adapters / "loha.safetensors", self.denoiser, 1.0)
        paths = {id(module): name for name, module in self.denoiser.named_modules()}
        self.layers = sorted(paths[id(lora.org_module[0])] for lora in network.loras)
        network.restore()

    def expected(self, name: str, scale: float, guidance: float) -> np.ndarray:
        return self.lycoris.lycoris_image(name, scale, prompt=PROMPT, seed=SEED, steps=STEPS, guidance=guidance)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory) -> LycorisCase:
    return LycorisCase(request.param, tmp_path_factory.mktemp(request.param))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(case):
    """Uncompiled; --fuse always, as SDXL's LyCORIS server (a fused swap is the one way in for most kinds)."""
    async with serving(case.model, case.adapters, fuse="always", compile=False) as running:
        yield running


async def _image(client, members: list[tuple[str, float]]):
    return await client.generate_image(PROMPT, adapters=members, seed=SEED, num_inference_steps=STEPS)


async def _guidance(client) -> float:
    return (await client.server_info()).default_guidance_scale


@pytest.mark.parametrize(("name", "scale"), CASES)
async def test_an_image_equals_the_lycoris_networks_own(client, case, name, scale) -> None:
    image = await _image(client, [(name, scale)])
    assert image.fused and image.changed_components == ("transformer",)
    actual = decode(image.data)
    assert_images_close(actual, case.expected(name, scale, await _guidance(client)), f"{case.model} {name}")
    base = decode((await _image(client, [])).data)
    assert abs(actual - base).max() >= MIN_ADAPTER_EFFECT, "the adapter must change the image"


async def test_the_listing_names_the_kind_and_every_layer_the_network_wrapped(client, case) -> None:
    for name in TRANSFORMER_KINDS:
        adapter = (await client.preload_adapter(name)).adapter
        assert (adapter.kinds, adapter.warnings) == ((LISTED_KIND.get(name, name),), ()), name
        assert adapter.component_layers == {"transformer": len(case.layers)}, name
        assert sorted(adapter.target_layers) == case.layers, name


async def test_an_unsupported_kind_is_refused_naming_it_and_the_server_serves_on(client) -> None:
    await assert_ia3_refused_and_serving_on(lambda members: _image(client, members))


@pytest.mark.parametrize("case", ["tiny-z-image"], indirect=True)
async def test_z_image_layers_keyed_by_patch_size_are_read(client, case) -> None:
    image = await _image(client, [(PATCH_LAYERS, 1.0)])
    assert image.fused
    assert_images_close(decode(image.data), case.expected(PATCH_LAYERS, 1.0, await _guidance(client)), PATCH_LAYERS)
