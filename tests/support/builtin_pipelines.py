"""Building, running and comparing the built-in models' pipelines, for the tests of the built-ins themselves.

A build is watched for what it does to torch's global RNG (a built-in must be the same pipeline whatever ran
before it, and change nothing for whatever runs after); an image is made as the engine's runner calls the pipeline
(the family's guidance arguments, the model's sequence length), so a family that reads guidance its own way
(Qwen-Image's true CFG, which runs only with a negative prompt) is run as it is served.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import DiffusionPipeline

from loraswap.server.engine.families import family_of
from loraswap.server.engine.models import builtin_model

PROMPT = "a photo of a cat, Größe 日本語 🙂"


@dataclass(frozen=True)
class WatchedBuild:
    """A built-in's pipeline, and whether building it left torch's global RNG as it was."""

    name: str
    pipe: DiffusionPipeline
    # The state, and so what the next draw gives, unchanged by the build.
    global_rng_kept: bool


def build_watched(name: str, torch_dtype: torch.dtype | None = None, layers: int | None = None) -> WatchedBuild:
    """Build the built-in `name`, noting whether the build drew from or reseeded torch's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        state = torch.get_rng_state()
        next_draw = torch.rand(4)
        torch.set_rng_state(state)
        pipe = builtin_model(name).build(torch_dtype, layers)
        kept = torch.equal(torch.get_rng_state(), state) and torch.equal(torch.rand(4), next_draw)
    return WatchedBuild(name, pipe, kept)


def build_after_other_draws(name: str) -> DiffusionPipeline:
    """Build the built-in `name` after the global RNG was seeded and drawn from otherwise than for any other build."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        torch.rand(7)
        return builtin_model(name).build()


def torch_modules(pipe: DiffusionPipeline) -> dict[str, torch.nn.Module]:
    """The pipeline's components that hold weights, by attribute name."""
    return {key: value for key, value in pipe.components.items() if isinstance(value, torch.nn.Module)}


def parameter_dtypes(pipe: DiffusionPipeline) -> set[torch.dtype]:
    """Every dtype among the parameters of the pipeline's modules."""
    return {p.dtype for module in torch_modules(pipe).values() for p in module.parameters()}


def assert_same_weights(expected: DiffusionPipeline, actual: DiffusionPipeline, *, cast: bool = False) -> None:
    """`actual` has the modules, tensors and values of `expected`; with `cast`, of `expected` cast to its dtypes."""
    expected_modules, actual_modules = torch_modules(expected), torch_modules(actual)
    assert expected_modules.keys() == actual_modules.keys()
    for key, module in expected_modules.items():
        want, got = module.state_dict(), actual_modules[key].state_dict()
        assert want.keys() == got.keys(), key
        for param, value in want.items():
            value = value.to(got[param].dtype) if cast else value
            assert got[param].dtype == value.dtype and torch.equal(got[param], value), f"{key}.{param}"


def generate(
    pipe: DiffusionPipeline,
    name: str,
    prompt: str = PROMPT,
    *,
    width: int | None = None,
    height: int | None = None,
    guidance_scale: float | None = None,
    num_inference_steps: int = 2,
    output_type: str = "np",
):
    """The images of one seeded call at the built-in's defaults (None: the default), with the arguments the
    engine's runner passes: the family's guidance ones against an empty negative prompt, the model's sequence
    length."""
    pipe.set_progress_bar_config(disable=True)
    defaults = builtin_model(name).defaults
    guidance = defaults.guidance_scale if guidance_scale is None else guidance_scale
    kwargs = family_of(pipe).pipeline_kwargs("", guidance, defaults)
    if defaults.max_sequence_length is not None:
        kwargs["max_sequence_length"] = defaults.max_sequence_length
    out = pipe(
        # prompt by keyword: FLUX.2's pipelines take reference images first.
        prompt=prompt, width=width or defaults.width, height=height or defaults.height,
        num_inference_steps=num_inference_steps, generator=torch.Generator("cpu").manual_seed(0),
        output_type=output_type, **kwargs,
    )  # fmt: skip
    return out.images


def assert_finite_image(image: np.ndarray, width: int, height: int) -> None:
    """One image of `width` x `height` pixels, finite and not flat."""
    assert image.shape == (1, height, width, 3)
    assert np.isfinite(image).all()
    assert image.std() > 0.01, "image should not be flat"


def assert_defaults_fit(name: str, pipe: DiffusionPipeline, *, published_guidance: bool = True) -> None:
    """The built-in's defaults are what its pipeline takes: a size its family allows for this pipeline (computed
    from it), at least the steps its scheduler needs, a sequence length where the family takes one and within the
    published one; with `published_guidance`, the guidance its family's published checkpoint of this kind (FLUX.2
    klein distilled or not, FLUX.1 with guidance embedded or not) runs at."""
    traits, defaults = family_of(pipe), builtin_model(name).defaults
    published = traits.published_defaults(pipe)
    multiple = traits.size_multiple(pipe)
    assert defaults.width % multiple == 0 and defaults.height % multiple == 0, multiple
    assert min(defaults.width, defaults.height) >= traits.min_size(pipe)
    assert defaults.num_inference_steps >= traits.min_steps(pipe)
    if published.max_sequence_length is None:
        assert defaults.max_sequence_length is None
    else:
        assert 0 < defaults.max_sequence_length <= published.max_sequence_length
    if published_guidance:
        assert defaults.guidance_scale == published.guidance_scale
        assert defaults.true_cfg_scale == published.true_cfg_scale
