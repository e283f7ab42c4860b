"""The tiny built-ins, one contract for all: each builds the same pipeline of its family's class whatever the global
RNG holds (and leaves it as it was), runs at its defaults and at the smallest sizes its family allows, reads its
prompt, runs guidance as its family says, takes a LoRA, casts to bfloat16 exactly, and exports to a folder that
loads offline as the same pipeline. What only the newer families' built-ins have (Qwen-Image's template, FLUX.2's
system prompt) and the full-size random ones are in test_family_models.py.
"""

from __future__ import annotations

import numpy as np
import peft
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusionXLPipeline,
    ZImagePipeline,
)

from loraswap.server.engine.families import WARM_UP_GUIDANCE, family_of
from loraswap.server.engine.models import builtin_model
from tests.support.builtin_pipelines import (
    WatchedBuild,
    assert_defaults_fit,
    assert_finite_image,
    assert_same_weights,
    build_after_other_draws,
    build_watched,
    generate,
    parameter_dtypes,
    torch_modules,
)

PIPELINE_CLASSES = {
    "shapes": FluxPipeline,
    "tiny-flux": FluxPipeline,
    "tiny-sdxl": StableDiffusionXLPipeline,
    "tiny-qwen-image": QwenImagePipeline,
    "tiny-z-image": ZImagePipeline,
    "tiny-flux2": Flux2Pipeline,
    "tiny-flux2-klein": Flux2KleinPipeline,
}
TINY = tuple(PIPELINE_CLASSES)
# shapes is trained here: its weights load from its own folder (whose path its modules record), and it runs at
# the settings it was trained for (true CFG 3 against an empty negative prompt), not at FLUX.1's published ones.
TRAINED_HERE = ("shapes",)
# The (tokenizer, text encoder) attributes a pipeline class may declare: FLUX.1's and SDXL's both, the newer ones the
# first.
TEXT_ENCODERS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
# The first tokenizer's kind by family: CLIP (FLUX.1, SDXL: lower-cased, 77 tokens) or byte-level BPE (Qwen2.5-VL,
# Qwen3, Mistral: any text decodes back as it was). FLUX.1's second is T5 (SentencePiece without byte fallback).
CLIP_TOKENIZERS = ("shapes", "tiny-flux", "tiny-sdxl")
BYTE_LEVEL_TOKENIZERS = ("tiny-qwen-image", "tiny-z-image", "tiny-flux2", "tiny-flux2-klein")


@pytest.fixture(scope="module", params=TINY)
def built(request: pytest.FixtureRequest) -> WatchedBuild:
    """One shared, unmodified pipeline per tiny model (tests must not mutate it)."""
    return build_watched(request.param)


@pytest.fixture(scope="module")
def default_image(built: WatchedBuild) -> np.ndarray:
    """The shared pipeline's image of the shared prompt at its defaults, in two steps."""
    return generate(built.pipe, built.name)


def test_pipeline_class_and_origin(built: WatchedBuild) -> None:
    name, pipe = built.name, built.pipe
    assert type(pipe) is PIPELINE_CLASSES[name]
    assert pipe.name_or_path == name
    modules = torch_modules(pipe)
    assert all(not module.training for module in modules.values())
    assert parameter_dtypes(pipe) == {torch.float32}
    assert {module.config._name_or_path for module in modules.values()} == {name}  # no folder of this machine


def test_build_leaves_global_rng_untouched(built: WatchedBuild) -> None:
    assert built.global_rng_kept


def test_a_second_build_has_the_same_weights_and_image(built: WatchedBuild, default_image: np.ndarray) -> None:
    """At the defaults: a finite image of the default size, the same from a build made after other draws."""
    name, first = built.name, built.pipe
    defaults = builtin_model(name).defaults
    assert_finite_image(default_image, defaults.width, defaults.height)
    second = build_after_other_draws(name)
    assert_same_weights(first, second)
    np.testing.assert_array_equal(generate(second, name), default_image)


def test_defaults_fit_the_pipeline(built: WatchedBuild) -> None:
    assert_defaults_fit(built.name, built.pipe, published_guidance=built.name not in TRAINED_HERE)


def test_the_smallest_allowed_sizes_come_out_exactly(built: WatchedBuild) -> None:
    """The family's size rule, computed from the pipeline, holds for the pipeline itself: at its smallest size and
    one multiple wider (an odd multiple for the patchified families), the image has exactly that size, where a
    pipeline given a size it cannot take rounds it."""
    name, pipe = built.name, built.pipe
    traits = family_of(pipe)
    height = traits.min_size(pipe)
    width = height + traits.size_multiple(pipe)
    (image,) = generate(
        pipe, name, "x", width=width, height=height, num_inference_steps=traits.min_steps(pipe), output_type="pil"
    )
    assert image.size == (width, height)


def test_the_prompt_reaches_the_image(built: WatchedBuild, default_image: np.ndarray) -> None:
    """Within the default sequence length: past the template Qwen-Image drops, FLUX.2's system prompt, the chat
    template's turns."""
    assert not np.array_equal(generate(built.pipe, built.name, "a dog"), default_image)


def _denoiser_images_per_step(built: WatchedBuild, guidance: float) -> float:
    """The images the denoiser computes per step at `guidance`, counted on its calls (batch 2, or a second call)."""
    pipe, traits = built.pipe, family_of(built.pipe)
    images: list[int] = []

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        latents = args[0] if args else kwargs["hidden_states"]
        images.append(len(latents))  # a batch tensor, or Z-Image's list of latents

    steps = traits.min_steps(pipe)
    hook = traits.denoiser(pipe).register_forward_pre_hook(count, with_kwargs=True)
    try:
        generate(pipe, built.name, guidance_scale=guidance, num_inference_steps=steps, output_type="latent")
    finally:
        hook.remove()
    return sum(images) / steps


def test_guidance_runs_as_the_family_says(built: WatchedBuild) -> None:
    """At the default guidance and on both sides of where guidance starts (Qwen-Image's true CFG above 1, Z-Image's
    CFG above 0, SDXL's above 1, FLUX's embedded or distilled guidance never), the denoiser computes the images per
    step that the family's traits (warm-up, cost model, attention shape) count on; shapes runs true CFG at any."""
    traits, defaults = family_of(built.pipe), builtin_model(built.name).defaults
    guidances = dict.fromkeys((defaults.guidance_scale, 0.0, 1.0, WARM_UP_GUIDANCE))
    counted = {guidance: _denoiser_images_per_step(built, guidance) for guidance in guidances}
    assert counted == {guidance: traits.guidance_batch(built.pipe, defaults, guidance) for guidance in guidances}


def test_lora_on_attention_changes_image(built: WatchedBuild, default_image: np.ndarray) -> None:
    name = built.name
    pipe = builtin_model(name).build()  # fresh: the adapter mutates the model
    config = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )
    denoiser = family_of(pipe).denoiser(pipe)
    denoiser.add_adapter(config)
    assert [n for n, _ in denoiser.named_parameters() if "lora_" in n]
    after = generate(pipe, name)
    assert np.abs(after - default_image).max() > 1e-3


def test_bfloat16_is_the_float32_build_cast(built: WatchedBuild) -> None:
    pipe = builtin_model(built.name).build(torch.bfloat16)
    assert parameter_dtypes(pipe) == {torch.bfloat16}
    assert_same_weights(built.pipe, pipe, cast=True)


def test_export_loads_offline_as_the_family_pipeline(
    built: WatchedBuild, default_image: np.ndarray, tmp_path, offline
) -> None:
    name, pipe = built.name, built.pipe
    path = builtin_model(name).export(tmp_path / name)
    assert path == tmp_path / name
    assert (path / "model_index.json").is_file()
    assert list(path.rglob("*.safetensors"))
    assert not list(path.rglob("*.bin"))
    for cls in (PIPELINE_CLASSES[name], DiffusionPipeline):
        loaded = cls.from_pretrained(path)
        assert type(loaded) is PIPELINE_CLASSES[name]
        assert_same_weights(pipe, loaded)
        np.testing.assert_allclose(generate(loaded, name), default_image, rtol=0, atol=1e-5)


def _vocab_size(encoder: torch.nn.Module) -> int:
    config = encoder.config
    return getattr(config, "text_config", config).vocab_size


def test_tokenizers_and_encoders_agree(built: WatchedBuild) -> None:
    """Every text encoder the pipeline class declares (FLUX.1's and SDXL's two, the newer families' one)."""
    pipe = built.pipe
    pairs = [(tok, enc) for tok, enc in TEXT_ENCODERS if tok in pipe.components]
    assert pairs and pairs[0] == TEXT_ENCODERS[0]
    for tok_name, enc_name in pairs:
        tokenizer, vocab_size = pipe.components[tok_name], _vocab_size(pipe.components[enc_name])
        assert len(tokenizer) == vocab_size
        ids = tokenizer("Ünïcödé ✓ 東京 \t tabs\nand  spaces <|endoftext|> </s>").input_ids
        assert max(ids) < vocab_size


@pytest.mark.parametrize("built", CLIP_TOKENIZERS, indirect=True)
def test_clip_tokenizer_is_byte_level(built: WatchedBuild) -> None:
    tokenizer = built.pipe.tokenizer
    assert tokenizer.model_max_length == 77
    text = "Crème brûlée 🍮 日本語 x"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids[1:-1]  # every byte is in the vocab
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == text.lower().replace(" ", "")
    padded = tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(padded) == 77


@pytest.mark.parametrize("built", BYTE_LEVEL_TOKENIZERS, indirect=True)
def test_byte_level_tokenizer_decodes_any_text_back(built: WatchedBuild) -> None:
    tokenizer = built.pipe.tokenizer
    assert tokenizer.decode(tokenizer("naïve café 🙂").input_ids) == "naïve café 🙂"


@pytest.mark.parametrize("built", ["tiny-flux"], indirect=True)
def test_t5_tokenizer(built: WatchedBuild) -> None:
    tokenizer = built.pipe.tokenizer_2
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    length = builtin_model("tiny-flux").defaults.max_sequence_length
    ids = tokenizer("Hello, World! ~42", padding="max_length", max_length=length).input_ids
    assert len(ids) == length
    assert tokenizer.unk_token_id not in ids
    eos_at = ids.index(tokenizer.eos_token_id)
    assert set(ids[eos_at + 1 :]) == {tokenizer.pad_token_id}
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, World! ~42"
    assert tokenizer.unk_token_id in tokenizer("naïve").input_ids
