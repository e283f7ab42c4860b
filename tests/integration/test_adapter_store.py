"""The adapter store through a real server: refusals that change nothing, kohya files, the cache's bookkeeping."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import pytest_asyncio
import torch
from safetensors.torch import save_file

from loraswap.client import LoraswapError, Progress
from loraswap.server.devtools.random_adapter import write_random_adapter
from loraswap.server.engine.models import builtin_model
from tests.support.images import assert_images_close, decode
from tests.support.kohya_files import FLUX_SINGLE, flux_double, kohya_file
from tests.support.reference import DiffusersReference
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_ADAPTER_BYTES = 2_000_000
GOOD = "good"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    flux = builtin_model("tiny-flux").build()
    write_random_adapter(flux, root / GOOD, rank=4, seed=1, init_std=0.5)
    write_random_adapter(flux, root / "other", rank=8, seed=2, init_std=0.5, target_modules=("to_q", "to_v"))
    write_random_adapter(flux, root / "third", rank=4, seed=8, init_std=0.5, target_modules=("to_q",))
    write_random_adapter(flux, root / "rank32", rank=32, seed=3)
    write_random_adapter(flux, root / "outside", rank=4, seed=4, target_modules=("norm1.linear",))
    write_random_adapter(builtin_model("tiny-sdxl").build(), root / "sdxl-on-flux", rank=4, seed=5)
    tensors = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 32, dtype=torch.int32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 4, dtype=torch.int32)}
    save_file(tensors, root / "int-dtype.safetensors")
    whole = (root / GOOD / "pytorch_lora_weights.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(whole[: len(whole) // 2])
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32 * 20_000)},
              root / "huge.safetensors")
    (root / "pickled.bin").write_bytes(b"\x80\x04not really a pickle")
    outside_dir = tmp_path_factory.mktemp("elsewhere")
    write_random_adapter(flux, outside_dir / "secret", rank=4, seed=6)
    os.symlink(outside_dir / "secret", root / "escape")
    _write_with_text_encoder(flux, root / "with-text-encoder")
    (root / "kohya-flux").mkdir()
    layout = {**flux_double(0), **flux_double(1), **FLUX_SINGLE}
    kohya_file(root / "kohya-flux" / "pytorch_lora_weights.safetensors",
                {module: (i, o) for module, (i, o, _) in layout.items()}, rank=4, seed=7)
    return root  # fmt: skip


def _write_with_text_encoder(pipe, directory):
    """A PEFT adapter on the transformer plus CLIP text-encoder LoRA factors, saved the diffusers way."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(11)
    pipe.transformer.add_adapter(LoraConfig(r=4, target_modules=["to_q"], init_lora_weights=False), "t")
    transformer_layers = get_peft_model_state_dict(pipe.transformer, adapter_name="t")
    pipe.transformer.delete_adapters("t")
    width = pipe.text_encoder.config.hidden_size
    text_encoder_layers = {
        "text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, width),
        "text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(width, 4),
    }
    FluxPipeline.save_lora_weights(
        directory, transformer_lora_layers=transformer_layers, text_encoder_lora_layers=text_encoder_layers
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(store_dir):
    # --fuse never: the unfused slot's refusals (under auto a rank-32 adapter is served fused, test_fused_adapters).
    async with serving("tiny-flux", store_dir, max_adapter_bytes=MAX_ADAPTER_BYTES, fuse="never") as running:
        yield running



REFUSALS = [
    ("rank32", grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_RANK_TOO_HIGH", "--max-rank"),
    ("outside", grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_LAYER_NOT_TARGETED", "--target-modules"),
    ("sdxl-on-flux", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_NO_DENOISER_LAYERS", "not a LoRA for this flux"),
    ("int-dtype", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_DTYPE", "floating point"),
    ("truncated", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_MALFORMED", "safetensors"),
    ("huge", grpc.StatusCode.RESOURCE_EXHAUSTED, "ADAPTER_TOO_LARGE", "--max-adapter-bytes"),
    ("pickled", grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_PICKLE_REFUSED", "safetensors only"),
    ("escape", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "outside the adapter directory"),
    ("hf:owner/repo", grpc.StatusCode.FAILED_PRECONDITION, "HUB_DISABLED", "--allow-hub"),
]


@pytest.mark.parametrize("rpc", ["generate", "preload"])
@pytest.mark.parametrize(("name", "code", "reason", "hint"), REFUSALS)
async def test_refused_adapter_leaves_the_model_unchanged(client, rpc, name, code, reason, hint):
    before = await client.generate_image("a boat", adapter=GOOD, seed=4, num_inference_steps=2)
    with pytest.raises(LoraswapError) as caught:
        if rpc == "generate":
            await client.generate_image("a boat", adapter=name, seed=4, num_inference_steps=2)
        else:
            await client.preload_adapter(name)
    assert (caught.value.code, caught.value.reason) == (code, reason)
    assert hint in caught.value.message
    after = await client.generate_image("a boat", adapter=GOOD, seed=4, num_inference_steps=2)
    assert after.data == before.data
    assert name not in {adapter.id for adapter in (await client.list_adapters()).adapters}
    assert (await client.server_info()).recompilations == 0


async def test_kohya_flux_file_matches_diffusers_own_loading(client, store_dir, exported_models):
    reference = DiffusersReference(exported_models["tiny-flux"], "flux", store_dir)
    info = await client.server_info()
    for scale in (1.0, 0.5):
        image = await client.generate_image(
            "a kite", adapter="kohya-flux", adapter_scale=scale, seed=3, num_inference_steps=3
        )
        expected = reference.image(
            "kohya-flux", scale, prompt="a kite", seed=3, steps=3, guidance=info.default_guidance_scale
        )
        assert_images_close(decode(image.data), expected)
    base = await client.generate_image("a kite", seed=3, num_inference_steps=3)
    assert abs(decode(base.data) - decode(image.data)).max() > 8  # the kohya adapter really acts


async def test_cold_load_is_reported_then_cached_with_bookkeeping(client):
    if "other" in {adapter.id for adapter in (await client.list_adapters()).adapters}:
        await client.evict("other")
    cold = await client.generate_image("a road", adapter="other", seed=1, num_inference_steps=2)
    warm = await client.generate_image("a road", adapter="other", seed=1, num_inference_steps=2)
    assert cold.timings.adapter_load_ms > 0 and warm.timings.adapter_load_ms == 0
    assert cold.data == warm.data
    listing = await client.list_adapters()
    entry = next(adapter for adapter in listing.adapters if adapter.id == "other")
    assert listing.adapters[0].id == "other"  # most recently used first
    assert entry.rank == 8 and entry.hits == 2 and entry.resident
    assert entry.source.endswith("other/pytorch_lora_weights.safetensors")
    assert all(layer.endswith(("to_q", "to_v")) for layer in entry.target_layers)
    assert entry.last_used_unix_ms > 0 and entry.size_bytes > 0
    assert listing.cache_bytes >= entry.size_bytes


async def test_evicting_an_adapter_in_use_lets_its_generation_finish(client):
    reference = await client.generate_image("a tower", adapter=GOOD, seed=2, num_inference_steps=40)
    await client.evict(GOOD)
    events = []
    started = asyncio.Event()

    async def run():
        async for event in client.generate("a tower", adapter=GOOD, seed=2, num_inference_steps=40):
            events.append(event)
            if isinstance(event, Progress):
                started.set()

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(started.wait(), 30)
    await client.evict(GOOD)
    await task
    assert events[-1].data == reference.data


async def test_lru_eviction_under_a_small_budget(store_dir):
    async with (
        serving("tiny-flux", store_dir, compile=False, adapter_cache_bytes=1) as running,
        client_of(running, default_timeout=60) as client,
    ):
        with pytest.raises(LoraswapError) as caught:
            await client.preload_adapter(GOOD)
        assert caught.value.reason == "ADAPTER_TOO_LARGE"
    good_bytes = None
    async with (
        serving("tiny-flux", store_dir, compile=False) as running,
        client_of(running, default_timeout=60) as client,
    ):
        good_bytes = (await client.preload_adapter(GOOD)).adapter.size_bytes
        other_bytes = (await client.preload_adapter("other")).adapter.size_bytes
    budget = good_bytes + other_bytes + 1
    async with (
        serving("tiny-flux", store_dir, compile=False, adapter_cache_bytes=budget) as running,
        client_of(running, default_timeout=60) as client,
    ):
        await client.preload_adapter(GOOD)
        await client.preload_adapter("other")
        await client.generate_image("x", adapter=GOOD, seed=1, num_inference_steps=1)  # GOOD is now newest
        await client.preload_adapter("third")  # over budget: the least recently used goes
        cached = [adapter.id for adapter in (await client.list_adapters()).adapters]
        assert cached == ["third", GOOD]
        assert (await client.list_adapters()).cache_bytes <= budget


async def test_hub_ids_are_served_from_a_local_hub_cache_offline(store_dir, tmp_path, monkeypatch):
    """With --allow-hub and HF_HUB_OFFLINE=1, `owner/name` and `hf:owner/name@rev` come from the Hub cache."""
    import shutil

    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--owner--name"
    commits = {"main": "a" * 40, "v1": "b" * 40}
    for ref, adapter in (("main", GOOD), ("v1", "other")):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commits[ref])
        snapshot = repo / "snapshots" / commits[ref]
        snapshot.mkdir(parents=True)
        shutil.copy(store_dir / adapter / "pytorch_lora_weights.safetensors", snapshot)

    async with (
        serving("tiny-flux", store_dir, compile=False, allow_hub=True) as running,
        client_of(running, default_timeout=60) as client,
    ):
        for hub_name, local_name in (("owner/name", GOOD), ("hf:owner/name@v1", "other")):
            from_hub = await client.generate_image("a hill", adapter=hub_name, seed=1, num_inference_steps=2)
            local = await client.generate_image("a hill", adapter=local_name, seed=1, num_inference_steps=2)
            assert from_hub.data == local.data and from_hub.adapter == hub_name
        sources = {adapter.id: adapter.source for adapter in (await client.list_adapters()).adapters}
        assert sources["owner/name"] == "hf://owner/name@main/pytorch_lora_weights.safetensors"
        with pytest.raises(LoraswapError) as caught:
            await client.preload_adapter("owner/not-cached")
        assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")


async def test_kohya_sdxl_file_matches_diffusers_own_loading(tmp_path, exported_models):
    from tests.support.kohya_files import sdxl_modules

    modules, alphas, _ = sdxl_modules("sgm_names")
    (tmp_path / "kohya-sdxl").mkdir()
    kohya_file(tmp_path / "kohya-sdxl" / "pytorch_lora_weights.safetensors", modules, rank=4, alphas=alphas, seed=9)
    reference = DiffusersReference(exported_models["tiny-sdxl"], "sdxl", tmp_path)
    async with (
        serving("tiny-sdxl", tmp_path, compile=False) as running,
        client_of(running, default_timeout=60) as client,
    ):
        info = await client.server_info()
        image = await client.generate_image("a kite", adapter="kohya-sdxl", seed=3, num_inference_steps=3)
        base = await client.generate_image("a kite", seed=3, num_inference_steps=3)
    expected = reference.image("kohya-sdxl", 1.0, prompt="a kite", seed=3, steps=3, guidance=info.default_guidance_scale)
    assert_images_close(decode(image.data), expected)
    assert abs(decode(base.data) - decode(image.data)).max() > 8


async def test_concurrent_first_requests_load_an_adapter_once(client):
    if "third" in {adapter.id for adapter in (await client.list_adapters()).adapters}:
        await client.evict("third")
    results = await asyncio.gather(
        *(client.preload_adapter("third") for _ in range(4)),
        *(client.generate_image("a cone", adapter="third", seed=1, num_inference_steps=1) for _ in range(2)),
    )
    preloads, images = results[:4], results[4:]
    # One load: every request that waited for it reports its time; a request that arrived after it finished
    # (the load takes about a millisecond, so a busy machine can order them so) reports a cache hit instead.
    waited = [result.adapter.load_ms for result in preloads if not result.already_cached]
    waited += [image.timings.adapter_load_ms for image in images if image.timings.adapter_load_ms > 0]
    assert waited and len(set(waited)) == 1 and waited[0] > 0
    (listed,) = [adapter for adapter in (await client.list_adapters()).adapters if adapter.id == "third"]
    assert listed.load_ms == waited[0]
    assert (await client.preload_adapter("third")).already_cached


async def test_text_encoder_layers_are_applied_and_reported_in_preload_listing_and_image(client):
    preloaded = await client.preload_adapter("with-text-encoder")
    assert preloaded.adapter.warnings == ()
    assert preloaded.adapter.component_layers["text_encoder"] > 0 and "transformer" in preloaded.adapter.component_layers
    (listed,) = [adapter for adapter in (await client.list_adapters()).adapters if adapter.id == "with-text-encoder"]
    assert listed.component_layers == preloaded.adapter.component_layers and listed.kinds == ("lora",)
    image = await client.generate_image("a bridge", adapter="with-text-encoder", seed=1, num_inference_steps=2)
    assert image.warnings == () and image.changed_components == ("text_encoder", "transformer")
    base = await client.generate_image("a bridge", seed=1, num_inference_steps=2)
    assert base.changed_components == ()


async def test_ignored_text_encoder_layers_are_dropped_with_a_warning_in_preload_and_image(store_dir):
    async with (
        serving("tiny-flux", store_dir, compile=False, text_encoder_layers="ignore") as running,
        client_of(running, default_timeout=60) as client,
    ):
        preloaded = await client.preload_adapter("with-text-encoder")
        (warning,) = preloaded.adapter.warnings
        assert "text_encoder" in warning and "ignored" in warning
        assert all(layer.endswith("to_q") for layer in preloaded.adapter.target_layers)
        assert set(preloaded.adapter.component_layers) == {"transformer"}
        image = await client.generate_image("a bridge", adapter="with-text-encoder", seed=1, num_inference_steps=2)
        assert image.warnings == (warning,) and image.changed_components == ("transformer",)
        # In a stack, the same warning names the member it is about.
        stacked = await client.generate_image(
            "a bridge", adapters=[("third", 0.5), ("with-text-encoder", 1.0)], seed=1, num_inference_steps=2
        )
        assert stacked.warnings == (f"with-text-encoder: {warning}",)


async def test_strict_adapters_refuse_text_encoder_layers(store_dir):
    async with (
        serving("tiny-flux", store_dir, compile=False, strict_adapters=True, text_encoder_layers="ignore") as running,
        client_of(running, default_timeout=60) as client,
    ):
        with pytest.raises(LoraswapError) as caught:
            await client.generate_image("a bridge", adapter="with-text-encoder", seed=1, num_inference_steps=2)
        assert (caught.value.code, caught.value.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "ADAPTER_TEXT_ENCODER_LAYERS",
        )
        assert "--strict-adapters" in caught.value.message
        with pytest.raises(LoraswapError) as caught:  # as a member of a stack too
            await client.generate_image(
                "a bridge", adapters=[GOOD, "with-text-encoder"], seed=1, num_inference_steps=2
            )
        assert caught.value.reason == "ADAPTER_TEXT_ENCODER_LAYERS"
