"""Tests for the builtin tiny FLUX / SDXL pipelines."""

from __future__ import annotations

import numpy as np
import peft
import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusionXLPipeline

from loraswap.server.engine.models import builtin_model

# The small built-in models (the full-size random ones are tested in tests/benchmarks/test_benchmarks.py).
PIPELINE_CLASSES = {"shapes": FluxPipeline, "tiny-flux": FluxPipeline, "tiny-sdxl": StableDiffusionXLPipeline}
MODELS = tuple(PIPELINE_CLASSES)
DENOISER = {"shapes": "transformer", "tiny-flux": "transformer", "tiny-sdxl": "unet"}
# What the pipelines themselves accept (shapes: 4x VAE downsampling times FLUX's 2x2 packing;
# tiny-flux: VAE factor 2 times the packing; tiny-sdxl: VAE factor 2).
PIPELINE_SIZE_MULTIPLE = {"shapes": 8, "tiny-flux": 4, "tiny-sdxl": 2}
PROMPT = "a photo of a cat, Größe 日本語 🙂"


def _generate(pipe: DiffusionPipeline, name: str, prompt: str = PROMPT, **overrides) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    kwargs = builtin_model(name).defaults.to_dict() | {"num_inference_steps": 2} | overrides
    out = pipe(prompt, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **kwargs)
    return out.images


def _modules(pipe: DiffusionPipeline) -> dict[str, torch.nn.Module]:
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


@pytest.fixture(scope="module", params=MODELS)
def built(request: pytest.FixtureRequest) -> tuple[str, DiffusionPipeline]:
    """One shared, unmodified pipeline per builtin model (tests must not mutate it)."""
    return request.param, builtin_model(request.param).build()


def test_pipeline_classes(built: tuple[str, DiffusionPipeline]) -> None:
    name, pipe = built
    assert type(pipe) is PIPELINE_CLASSES[name]
    assert pipe.name_or_path == name
    assert all(not m.training for m in _modules(pipe).values())


def test_build_is_deterministic(built: tuple[str, DiffusionPipeline]) -> None:
    name, first = built
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # a different global RNG state must not matter
        torch.rand(7)
        second = builtin_model(name).build()
    mods1, mods2 = _modules(first), _modules(second)
    assert mods1.keys() == mods2.keys()
    for key in mods1:
        sd1, sd2 = mods1[key].state_dict(), mods2[key].state_dict()
        assert sd1.keys() == sd2.keys(), key
        for param in sd1:
            assert torch.equal(sd1[param], sd2[param]), f"{key}.{param}"


def test_build_leaves_global_rng_untouched() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        state = torch.get_rng_state()
        expected = torch.rand(4)
        torch.set_rng_state(state)
        for name in MODELS:
            builtin_model(name).build()
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(torch.rand(4), expected)


def test_generation(built: tuple[str, DiffusionPipeline]) -> None:
    name, pipe = built
    image = _generate(pipe, name, width=64, height=64)
    assert image.shape == (1, 64, 64, 3)
    assert np.isfinite(image).all()
    assert image.std() > 0.01, "image should not be flat"
    np.testing.assert_array_equal(image, _generate(pipe, name, width=64, height=64))


def test_generation_non_square_pil(built: tuple[str, DiffusionPipeline]) -> None:
    name, pipe = built
    mult = PIPELINE_SIZE_MULTIPLE[name]
    width, height = 16 * mult, 8 * mult
    pipe.set_progress_bar_config(disable=True)
    kwargs = builtin_model(name).defaults.to_dict() | {"num_inference_steps": 1, "width": width, "height": height}
    (image,) = pipe("x", generator=torch.Generator("cpu").manual_seed(0), **kwargs).images
    assert image.size == (width, height)


def test_prompt_changes_image(built: tuple[str, DiffusionPipeline]) -> None:
    name, pipe = built
    assert not np.array_equal(_generate(pipe, name, "a cat"), _generate(pipe, name, "a dog"))


def test_export_roundtrip(built: tuple[str, DiffusionPipeline], tmp_path, offline) -> None:
    name, pipe = built
    path = builtin_model(name).export(tmp_path / name)
    assert path == tmp_path / name
    assert (path / "model_index.json").is_file()
    assert list(path.rglob("*.safetensors"))
    assert not list(path.rglob("*.bin"))

    expected = _generate(pipe, name)
    for cls in (PIPELINE_CLASSES[name], DiffusionPipeline):
        loaded = cls.from_pretrained(path)
        assert type(loaded) is PIPELINE_CLASSES[name]
        for key, module in _modules(pipe).items():
            loaded_sd = getattr(loaded, key).state_dict()
            for param, value in module.state_dict().items():
                assert torch.equal(value, loaded_sd[param]), f"{key}.{param}"
        np.testing.assert_allclose(_generate(loaded, name), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_lora_on_attention_changes_image(name: str) -> None:
    pipe = builtin_model(name).build()  # fresh: the adapter mutates the model
    before = _generate(pipe, name)
    config = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )
    denoiser = getattr(pipe, DENOISER[name])
    denoiser.add_adapter(config)
    lora_params = [n for n, _ in denoiser.named_parameters() if "lora_" in n]
    assert lora_params
    after = _generate(pipe, name)
    assert np.abs(after - before).max() > 1e-3


def test_tokenizers_and_encoders_agree(built: tuple[str, DiffusionPipeline]) -> None:
    _, pipe = built
    for tok_name, enc_name in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        tokenizer, encoder = getattr(pipe, tok_name), getattr(pipe, enc_name)
        assert len(tokenizer) == encoder.config.vocab_size
        ids = tokenizer("Ünïcödé ✓ 東京 \t tabs\nand  spaces <|endoftext|> </s>").input_ids
        assert max(ids) < encoder.config.vocab_size


def test_clip_tokenizer_is_byte_level(built: tuple[str, DiffusionPipeline]) -> None:
    _, pipe = built
    tokenizer = pipe.tokenizer
    assert tokenizer.model_max_length == 77
    text = "Crème brûlée 🍮 日本語 x"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids[1:-1]  # every byte is in the vocab
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == text.lower().replace(" ", "")
    padded = tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(padded) == 77


def test_t5_tokenizer() -> None:
    tiny_flux = builtin_model("tiny-flux")
    tokenizer = tiny_flux.build().tokenizer_2
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    length = tiny_flux.defaults.max_sequence_length
    ids = tokenizer("Hello, World! ~42", padding="max_length", max_length=length).input_ids
    assert len(ids) == length
    assert tokenizer.unk_token_id not in ids
    eos_at = ids.index(tokenizer.eos_token_id)
    assert set(ids[eos_at + 1 :]) == {tokenizer.pad_token_id}
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, World! ~42"
    assert tokenizer.unk_token_id in tokenizer("naïve").input_ids


def test_defaults() -> None:
    flux, sdxl = builtin_model("tiny-flux").defaults.to_dict(), builtin_model("tiny-sdxl").defaults.to_dict()
    assert flux == {
        "width": 64,
        "height": 64,
        "num_inference_steps": 4,
        "guidance_scale": 3.5,
        "max_sequence_length": 32,
    }
    assert sdxl == {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 5.0}
    for name in MODELS:
        d = builtin_model(name).defaults
        assert d.width % PIPELINE_SIZE_MULTIPLE[name] == 0 and d.height % PIPELINE_SIZE_MULTIPLE[name] == 0


def test_torch_dtype() -> None:
    pipe = builtin_model("tiny-flux").build(torch.bfloat16)
    assert {p.dtype for m in _modules(pipe).values() for p in m.parameters()} == {torch.bfloat16}
    reference = builtin_model("tiny-flux").build()
    ref_sd = reference.transformer.state_dict()
    for param, value in pipe.transformer.state_dict().items():
        assert torch.equal(value, ref_sd[param].to(torch.bfloat16)), param
