"""What only the newer families' built-ins have: the tiny ones' text templates (Qwen-Image's dropped prefix, FLUX.2's
system prompt), and the full-size random ones (random-qwen-image, random-z-image, random-flux2-klein), which have
the published layer widths at any depth and defaults their pipelines take. The contract every tiny built-in meets
(same build every time, runs, exports) is test_tiny_models.py's.

The random ones are built at depth 1 (about 0.4 to 0.9 B parameters each, a few seconds), once each; random-qwen-image
also runs two steps at 64 px. Full depth (3.9 to 20 B parameters) is for a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, QwenImagePipeline, ZImagePipeline

from loraswap.server.engine.adapters.sources import normalise
from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import builtin_model, latent_rgb
from tests.support.builtin_pipelines import (
    WatchedBuild,
    assert_defaults_fit,
    build_watched,
    generate,
    parameter_dtypes,
)

# The compatibility group (adapters/sources/base_model.py) of the published checkpoint whose architecture each newer
# pipeline class's built-ins have: the base they must declare, so that its adapters fit them and a sibling's do not.
BASE_GROUPS = {
    QwenImagePipeline: "qwen-image",
    ZImagePipeline: "z-image",
    Flux2Pipeline: "flux2-dev",
    Flux2KleinPipeline: "flux2-klein-4b",
}

# name: (pipeline class, full depth, the message for a depth out of range, {module: (in_features, out_features)} at
# depth 1, as the census of the full-size transformers lists them, {repeated blocks: count at depth 1})
RANDOM_SHAPES = {
    "random-qwen-image": (
        QwenImagePipeline, 60, "use 1 to 60 transformer blocks",
        {"img_in": (64, 3072), "txt_in": (3584, 3072), "proj_out": (3072, 64),
         "transformer_blocks.0.attn.to_q": (3072, 3072), "transformer_blocks.0.attn.add_k_proj": (3072, 3072),
         "transformer_blocks.0.img_mod.1": (3072, 18432), "transformer_blocks.0.img_mlp.net.0.proj": (3072, 12288),
         "transformer_blocks.0.txt_mlp.net.2": (12288, 3072)},
        {"transformer_blocks": 1},
    ),
    "random-z-image": (
        ZImagePipeline, 30, "use 1 to 30 main layers",
        {"all_x_embedder.2-1": (64, 3840), "cap_embedder.1": (2560, 3840), "layers.0.attention.to_q": (3840, 3840),
         "layers.0.feed_forward.w1": (3840, 10240), "layers.0.feed_forward.w2": (10240, 3840),
         "layers.0.adaLN_modulation.0": (256, 15360), "noise_refiner.1.attention.to_out.0": (3840, 3840),
         "context_refiner.1.feed_forward.w3": (3840, 10240)},
        {"layers": 1, "noise_refiner": 2, "context_refiner": 2},
    ),
    "random-flux2-klein": (
        Flux2KleinPipeline, 5, "use 1 to 5 double-stream blocks",
        {"x_embedder": (128, 3072), "context_embedder": (7680, 3072), "double_stream_modulation_img.linear": (3072, 18432),
         "transformer_blocks.0.attn.to_q": (3072, 3072), "transformer_blocks.0.ff.linear_in": (3072, 18432),
         "transformer_blocks.0.ff_context.linear_out": (9216, 3072),
         "single_transformer_blocks.3.attn.to_qkv_mlp_proj": (3072, 27648),
         "single_transformer_blocks.3.attn.to_out": (12288, 3072)},
        {"transformer_blocks": 1, "single_transformer_blocks": 4},
    ),
}  # fmt: skip
RANDOM = tuple(RANDOM_SHAPES)


@pytest.fixture(scope="module", params=RANDOM)
def random_built(request: pytest.FixtureRequest) -> WatchedBuild:
    """One shared, unmodified random model at depth 1, in bfloat16 (its serving dtype); tests must not mutate it."""
    return build_watched(request.param, layers=1)


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


@pytest.mark.parametrize("name", RANDOM)
def test_random_models_refuse_depths_out_of_range(name: str) -> None:
    _, full, message, _, _ = RANDOM_SHAPES[name]
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


def test_random_models_have_the_published_widths_at_depth_1(random_built: WatchedBuild) -> None:
    name, pipe = random_built.name, random_built.pipe
    pipeline_class, _, _, widths, blocks = RANDOM_SHAPES[name]
    assert type(pipe) is pipeline_class and pipe.name_or_path == name
    transformer = pipe.transformer
    for module_name, (in_features, out_features) in widths.items():
        linear = transformer.get_submodule(module_name)
        assert (linear.in_features, linear.out_features) == (in_features, out_features), module_name
    assert {key: len(getattr(transformer, key)) for key in blocks} == blocks
    assert parameter_dtypes(pipe) == {torch.bfloat16}
    assert not _meta_tensors(transformer)  # Qwen-Image's RoPE tables are plain attributes, rebuilt after to_empty
    assert pipe.vae_scale_factor == 8
    # The published VAE's latent space, so the step previews use the family's published projection, not grey.
    assert latent_rgb(name, pipe).channels == family_of(pipe).latent_channels(pipe)


def test_random_build_leaves_global_rng_untouched(random_built: WatchedBuild) -> None:
    assert random_built.global_rng_kept


def test_random_models_defaults_fit_and_declare_their_family_s_base(random_built: WatchedBuild) -> None:
    assert_defaults_fit(random_built.name, random_built.pipe)
    base = builtin_model(random_built.name).base_model
    assert normalise(base).group == BASE_GROUPS[type(random_built.pipe)]


@pytest.mark.parametrize("random_built", ["random-qwen-image"], indirect=True)
def test_random_qwen_image_runs(random_built: WatchedBuild) -> None:
    """The one random model with state outside its parameters (its RoPE tables) runs; the others' steps are only
    their weights' cost, 10 to 20 s each on two cores."""
    image = generate(random_built.pipe, random_built.name, width=64, height=64)  # 2 steps: 1 gives NaN here
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
