"""The built-in models of the Qwen-Image, Z-Image and FLUX.2 families: the tiny ones build, run, export and load
back as their pipeline class; the full-size random ones have the published layer widths at any depth.

The random ones are built at depth 1 (about 0.4 to 0.9 B parameters each, a few seconds); random-qwen-image also
runs two steps at 64 px. Full depth (3.9 to 20 B parameters) is for a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, Flux2KleinPipeline, Flux2Pipeline, QwenImagePipeline, ZImagePipeline

from loraswap.server.engine.adapters.sources import FLUX2_DEV, FLUX2_KLEIN_4B, QWEN_IMAGE, Z_IMAGE_TURBO
from loraswap.server.engine.models import BUILTINS, builtin_model, load_pipeline
from loraswap.server.engine.types import ModelDefaults

PIPELINE_CLASSES = {
    "tiny-qwen-image": QwenImagePipeline,
    "tiny-z-image": ZImagePipeline,
    "tiny-flux2": Flux2Pipeline,
    "tiny-flux2-klein": Flux2KleinPipeline,
    "random-qwen-image": QwenImagePipeline,
    "random-z-image": ZImagePipeline,
    "random-flux2-klein": Flux2KleinPipeline,
}
TINY = tuple(name for name in PIPELINE_CLASSES if name.startswith("tiny-"))
RANDOM = tuple(name for name in PIPELINE_CLASSES if name.startswith("random-"))

# name: (generation defaults as written to loraswap_generation.json, base model)
EXPECTED_DEFAULTS = {
    "tiny-qwen-image": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 32},
        QWEN_IMAGE,
    ),
    "tiny-z-image": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 0.0, "max_sequence_length": 32},
        Z_IMAGE_TURBO,
    ),
    "tiny-flux2": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 64},
        FLUX2_DEV,
    ),
    "tiny-flux2-klein": (
        {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "max_sequence_length": 32},
        FLUX2_KLEIN_4B,
    ),
    "random-qwen-image": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 32},
        QWEN_IMAGE,
    ),
    "random-z-image": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 0.0, "max_sequence_length": 32},
        Z_IMAGE_TURBO,
    ),
    "random-flux2-klein": (
        {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 1.0, "max_sequence_length": 32},
        FLUX2_KLEIN_4B,
    ),
}  # fmt: skip
# Qwen-Image runs true CFG only when a negative prompt is given (an empty one counts).
CALL_EXTRAS = {"tiny-qwen-image": {"negative_prompt": ""}, "random-qwen-image": {"negative_prompt": ""}}
PROMPT = "a photo of a cat, Größe 日本語 🙂"

# name: (full depth, the message for a depth out of range, {module: (in_features, out_features)} at depth 1, as the
# census of the full-size transformers lists them, {repeated blocks: count at depth 1})
RANDOM_SHAPES = {
    "random-qwen-image": (
        60, "use 1 to 60 transformer blocks",
        {"img_in": (64, 3072), "txt_in": (3584, 3072), "proj_out": (3072, 64),
         "transformer_blocks.0.attn.to_q": (3072, 3072), "transformer_blocks.0.attn.add_k_proj": (3072, 3072),
         "transformer_blocks.0.img_mod.1": (3072, 18432), "transformer_blocks.0.img_mlp.net.0.proj": (3072, 12288),
         "transformer_blocks.0.txt_mlp.net.2": (12288, 3072)},
        {"transformer_blocks": 1},
    ),
    "random-z-image": (
        30, "use 1 to 30 main layers",
        {"all_x_embedder.2-1": (64, 3840), "cap_embedder.1": (2560, 3840), "layers.0.attention.to_q": (3840, 3840),
         "layers.0.feed_forward.w1": (3840, 10240), "layers.0.feed_forward.w2": (10240, 3840),
         "layers.0.adaLN_modulation.0": (256, 15360), "noise_refiner.1.attention.to_out.0": (3840, 3840),
         "context_refiner.1.feed_forward.w3": (3840, 10240)},
        {"layers": 1, "noise_refiner": 2, "context_refiner": 2},
    ),
    "random-flux2-klein": (
        5, "use 1 to 5 double-stream blocks",
        {"x_embedder": (128, 3072), "context_embedder": (7680, 3072), "double_stream_modulation_img.linear": (3072, 18432),
         "transformer_blocks.0.attn.to_q": (3072, 3072), "transformer_blocks.0.ff.linear_in": (3072, 18432),
         "transformer_blocks.0.ff_context.linear_out": (9216, 3072),
         "single_transformer_blocks.3.attn.to_qkv_mlp_proj": (3072, 27648),
         "single_transformer_blocks.3.attn.to_out": (12288, 3072)},
        {"transformer_blocks": 1, "single_transformer_blocks": 4},
    ),
}  # fmt: skip


def _generate(pipe: DiffusionPipeline, name: str, prompt: str = PROMPT, **overrides) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    kwargs = builtin_model(name).defaults.to_dict() | CALL_EXTRAS.get(name, {}) | {"num_inference_steps": 2}
    # prompt by keyword: FLUX.2's pipelines take reference images first.
    out = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **kwargs | overrides)
    return out.images


def _modules(pipe: DiffusionPipeline) -> dict[str, torch.nn.Module]:
    return {key: value for key, value in pipe.components.items() if isinstance(value, torch.nn.Module)}


def _vocab_size(encoder: torch.nn.Module) -> int:
    config = encoder.config
    return getattr(config, "text_config", config).vocab_size


@pytest.fixture(scope="module", params=TINY)
def built(request: pytest.FixtureRequest) -> tuple[str, DiffusionPipeline]:
    """One shared, unmodified pipeline per tiny model (tests must not mutate it)."""
    return request.param, builtin_model(request.param).build()


@pytest.mark.parametrize("name", PIPELINE_CLASSES)
def test_registry_facts(name: str) -> None:
    defaults, base = EXPECTED_DEFAULTS[name]
    model = builtin_model(name)
    assert model.defaults.to_dict() == defaults
    assert ModelDefaults.from_dict(defaults) == model.defaults
    assert model.base_model == base
    random = name in RANDOM
    assert (model.dtype, model.takes_layers, model.exportable) == (
        ("bfloat16", True, False) if random else (None, False, True)
    )
    assert model.adapter_dir is None and model.latent_rgb is None


def test_the_new_models_follow_the_older_ones_in_the_registry() -> None:
    assert list(BUILTINS)[-len(PIPELINE_CLASSES) :] == list(PIPELINE_CLASSES)


def test_layers_are_refused_for_a_tiny_model() -> None:
    with pytest.raises(ValueError) as caught:
        load_pipeline("tiny-z-image", None, layers=1)
    assert str(caught.value) == (
        "--layers applies to random-flux, random-qwen-image, random-z-image and random-flux2-klein only, "
        "not to 'tiny-z-image'"
    )


def test_pipeline_class_and_origin(built: tuple[str, DiffusionPipeline]) -> None:
    name, pipe = built
    assert type(pipe) is PIPELINE_CLASSES[name]
    assert pipe.name_or_path == name
    modules = _modules(pipe)
    assert all(not module.training for module in modules.values())
    assert {p.dtype for module in modules.values() for p in module.parameters()} == {torch.float32}
    assert all(module.config._name_or_path == name for module in modules.values())


def test_sizes_fit_the_pipeline(built: tuple[str, DiffusionPipeline]) -> None:
    name, pipe = built
    defaults = builtin_model(name).defaults
    multiple = pipe.vae_scale_factor * 2  # VAE factor times the 2x2 latent patches
    assert multiple == 4
    assert defaults.width % multiple == 0 and defaults.height % multiple == 0


def test_two_steps_give_a_finite_image_identical_across_builds(built: tuple[str, DiffusionPipeline]) -> None:
    name, first = built
    image = _generate(first, name)
    assert image.shape == (1, 64, 64, 3)
    assert np.isfinite(image).all()
    assert image.std() > 0.01, "image should not be flat"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # a different global RNG state must not matter
        second = builtin_model(name).build()
    for key, module in _modules(first).items():
        again = getattr(second, key).state_dict()
        for param, value in module.state_dict().items():
            assert torch.equal(value, again[param]), f"{key}.{param}"
    np.testing.assert_array_equal(_generate(second, name), image)


def test_build_leaves_global_rng_untouched() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        state = torch.get_rng_state()
        for name in TINY:
            builtin_model(name).build()
        assert torch.equal(torch.get_rng_state(), state)


def test_the_prompt_reaches_the_image(built: tuple[str, DiffusionPipeline]) -> None:
    """Within the default sequence length: past the template Qwen-Image drops, FLUX.2's system prompt, the chat
    template's turns."""
    name, pipe = built
    assert not np.array_equal(_generate(pipe, name, "a cat"), _generate(pipe, name, "a dog"))


def test_tokenizer_and_text_encoder_agree(built: tuple[str, DiffusionPipeline]) -> None:
    _, pipe = built
    vocab_size = _vocab_size(pipe.text_encoder)
    assert len(pipe.tokenizer) == vocab_size
    ids = pipe.tokenizer("Ünïcödé ✓ 東京 \t tabs\nand  spaces <|endoftext|> </s>").input_ids
    assert max(ids) < vocab_size
    assert pipe.tokenizer.decode(pipe.tokenizer("naïve café 🙂").input_ids) == "naïve café 🙂"  # byte-level


def test_qwen_image_drops_exactly_its_template() -> None:
    pipe = builtin_model("tiny-qwen-image").build()
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34


def test_flux2_system_prompt_leaves_room_for_the_prompt() -> None:
    pipe = builtin_model("tiny-flux2").build()
    system = [{"role": "system", "content": [{"type": "text", "text": pipe.system_message}]}]
    ids = pipe.tokenizer.apply_chat_template([system], tokenize=True, return_dict=True)["input_ids"][0]
    assert len(ids) == 35
    assert builtin_model("tiny-flux2").defaults.max_sequence_length >= len(ids) + 16


def test_bfloat16_is_the_float32_build_cast() -> None:
    for name in TINY:
        pipe, reference = builtin_model(name).build(torch.bfloat16), builtin_model(name).build()
        assert {p.dtype for module in _modules(pipe).values() for p in module.parameters()} == {torch.bfloat16}
        expected = reference.transformer.state_dict()
        for param, value in pipe.transformer.state_dict().items():
            assert torch.equal(value, expected[param].to(torch.bfloat16)), f"{name}: {param}"


def test_export_loads_offline_as_the_family_pipeline(built: tuple[str, DiffusionPipeline], tmp_path, offline) -> None:
    name, pipe = built
    path = builtin_model(name).export(tmp_path / name)
    assert (path / "model_index.json").is_file() and list(path.rglob("*.safetensors"))
    assert not list(path.rglob("*.bin"))
    loaded = DiffusionPipeline.from_pretrained(path)
    assert type(loaded) is PIPELINE_CLASSES[name]
    for key, module in _modules(pipe).items():
        loaded_state = getattr(loaded, key).state_dict()
        for param, value in module.state_dict().items():
            assert torch.equal(value, loaded_state[param]), f"{key}.{param}"
    np.testing.assert_allclose(_generate(loaded, name), _generate(pipe, name), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", RANDOM)
def test_random_models_refuse_depths_out_of_range(name: str) -> None:
    full, message, _, _ = RANDOM_SHAPES[name]
    for layers in (0, full + 1):
        with pytest.raises(ValueError, match=message):
            builtin_model(name).build(layers=layers)


def _meta_tensors(module: torch.nn.Module) -> list[str]:
    """Every tensor of `module` still on the meta device: parameters, buffers, and plain tensor attributes."""
    left = [name for name, tensor in (*module.named_parameters(), *module.named_buffers()) if tensor.is_meta]
    for name, submodule in module.named_modules():
        left += [
            f"{name}.{attr}" for attr, value in vars(submodule).items() if torch.is_tensor(value) and value.is_meta
        ]
    return left


@pytest.mark.parametrize("name", RANDOM)
def test_random_models_have_the_published_widths_at_depth_1(name: str) -> None:
    _, _, widths, blocks = RANDOM_SHAPES[name]
    pipe = builtin_model(name).build(layers=1)  # bfloat16, its serving dtype
    assert type(pipe) is PIPELINE_CLASSES[name] and pipe.name_or_path == name
    transformer = pipe.transformer
    for module_name, (in_features, out_features) in widths.items():
        linear = transformer.get_submodule(module_name)
        assert (linear.in_features, linear.out_features) == (in_features, out_features), module_name
    assert {key: len(getattr(transformer, key)) for key in blocks} == blocks
    assert {p.dtype for module in _modules(pipe).values() for p in module.parameters()} == {torch.bfloat16}
    assert not _meta_tensors(transformer)  # Qwen-Image's RoPE tables are plain attributes, rebuilt after to_empty
    assert pipe.vae_scale_factor == 8


def test_random_qwen_image_runs() -> None:
    """The one random model with state outside its parameters (its RoPE tables) runs; the others' steps are only
    their weights' cost, 10 to 20 s each on two cores."""
    pipe = builtin_model("random-qwen-image").build(layers=1)
    image = _generate(pipe, "random-qwen-image", width=64, height=64)  # 2 steps: its scheduler gives NaN for 1
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
