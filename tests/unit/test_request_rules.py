"""RequestRules: every request field is checked against the model's limits, and unset ones take its defaults.

The rules are a plain frozen value: built here directly, with no pipeline and no torch.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from loraswap.server.engine.config import DEFAULT_MAX_STACK
from loraswap.server.engine.errors import InvalidRequestError
from loraswap.server.engine.request_rules import (
    MAX_ADAPTER_SCALE,
    MAX_GUIDANCE,
    MAX_PROMPT_CHARS,
    MAX_STEPS,
    RequestRules,
)
from loraswap.server.engine.types import GenerationRequest, ImageFormat, ModelDefaults, StackedAdapter

DEFAULTS = ModelDefaults(width=64, height=48, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32)
RULES = RequestRules(defaults=DEFAULTS, size_multiple=4, min_size=8, max_size=128)


def request(**fields) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "a boat", **fields})


# request fields, the field the error names, and a piece of the message that says what would be valid
BAD_REQUESTS = [
    (dict(prompt=""), "prompt", "prompt is empty"),
    (dict(prompt=" \n\t"), "prompt", "prompt is empty"),
    (dict(prompt="x" * (MAX_PROMPT_CHARS + 1)), "prompt", f"limited to {MAX_PROMPT_CHARS} characters"),
    (dict(negative_prompt="x" * (MAX_PROMPT_CHARS + 1)), "prompt", f"limited to {MAX_PROMPT_CHARS} characters"),
    (dict(num_inference_steps=0), "num_inference_steps", f"use 1 to {MAX_STEPS}, or leave it unset"),
    (dict(num_inference_steps=MAX_STEPS + 1), "num_inference_steps", "the model's default (4)"),
    (dict(guidance_scale=-0.5), "guidance_scale", f"use 0 to {MAX_GUIDANCE}"),
    (dict(guidance_scale=MAX_GUIDANCE + 0.5), "guidance_scale", "guidance_scale is 50.5"),
    (dict(adapter="a", adapter_scale=MAX_ADAPTER_SCALE + 0.5), "adapter_scale", f"use -{MAX_ADAPTER_SCALE} to"),
    (dict(adapter="a", adapter_scale=-MAX_ADAPTER_SCALE - 1), "adapter_scale", "adapter_scale is -9.0"),
    (dict(width=66), "width", "multiple of 4 between 8 and 128 for this model (nearest valid: 64)"),
    (dict(width=70), "width", "(nearest valid: 72)"),
    (dict(width=4), "width", "(nearest valid: 8)"),
    (dict(width=1000), "width", "(nearest valid: 128)"),
    (dict(height=0), "height", "height is 0"),
    (dict(height=132), "height", "between 8 and 128"),
    (dict(seed=-1), "seed", "[0, 2^64)"),
    (dict(seed=2**64), "seed", "[0, 2^64)"),
]


@pytest.mark.parametrize(
    ("fields", "field", "hint"), BAD_REQUESTS, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD_REQUESTS)]
)
def test_bad_field_is_refused_by_name(fields, field, hint):
    with pytest.raises(InvalidRequestError) as caught:
        RULES.resolve(request(**fields))
    assert caught.value.metadata["field"] == field
    assert hint in caught.value.message
    assert str(caught.value.reason) == "INVALID_REQUEST"


@pytest.mark.parametrize("field", ["width", "height"])
def test_size_errors_carry_the_multiple(field):
    with pytest.raises(InvalidRequestError) as caught:
        RULES.resolve(request(**{field: 10}))
    assert caught.value.metadata["multiple"] == "4"


def test_unset_fields_take_the_model_defaults():
    params = RULES.resolve(GenerationRequest(prompt="a boat"))
    assert (params.width, params.height) == (64, 48)
    assert (params.num_inference_steps, params.guidance_scale) == (4, 3.5)
    assert params.adapter == "" and params.adapter_scale == 1.0
    assert params.negative_prompt == "" and params.image_format is ImageFormat.PNG
    assert 0 <= params.seed < 2**63


def test_set_fields_pass_through():
    params = RULES.resolve(
        GenerationRequest(
            prompt="a boat", negative_prompt="fog", adapter="style", adapter_scale=-2, num_inference_steps=7,
            guidance_scale=0.0, width=128, height=8, seed=2**64 - 1, image_format=ImageFormat.WEBP,
        )
    )  # fmt: skip
    assert dataclasses.astuple(params) == (
        "a boat", "fog", (("style", -2.0),), 7, 0.0, 128, 8, 2**64 - 1, ImageFormat.WEBP, 0, None
    )  # fmt: skip
    assert (params.adapter, params.adapter_scale) == ("style", -2.0)


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_inference_steps=1), dict(num_inference_steps=MAX_STEPS), dict(guidance_scale=0.0),
        dict(guidance_scale=MAX_GUIDANCE), dict(adapter="a", adapter_scale=MAX_ADAPTER_SCALE),
        dict(adapter="a", adapter_scale=-MAX_ADAPTER_SCALE), dict(width=8, height=128), dict(seed=0),
        dict(prompt="x" * MAX_PROMPT_CHARS),
    ],
)  # fmt: skip
def test_limits_themselves_are_allowed(fields):
    RULES.resolve(request(**fields))


def test_a_strength_without_an_adapter_is_dropped():
    assert RULES.resolve(request(adapter_scale=0.5)).adapter_scale == 1.0
    assert RULES.resolve(request(adapter="a", adapter_scale=0.5)).adapter_scale == 0.5


def stack(*entries) -> tuple[StackedAdapter, ...]:
    return tuple(StackedAdapter(*entry) for entry in entries)


# stack requests, the reason and field the error carries, and a piece of its message
BAD_STACKS = [
    (dict(adapter="a", adapters=stack(("b",))), "ADAPTER_MISMATCH", "adapter", "both adapter and adapters"),
    (dict(adapter_scale=0.5, adapters=stack(("b",))), "ADAPTER_MISMATCH", "adapter_scale", "its own scale"),
    (dict(adapters=stack(*[(f"a{i}",) for i in range(RULES.max_stack + 1)])), "INVALID_REQUEST", "adapters",
     f"stacks at most {RULES.max_stack} (--max-stack)"),
    (dict(adapters=stack(("a", 0.5), ("b",), ("a", 1.0))), "INVALID_REQUEST", "adapters", "'a' appears twice"),
    (dict(adapters=stack(("a",), ("",))), "INVALID_REQUEST", "adapters", "adapters[1].adapter is empty"),
    (dict(adapters=stack(("a",), ("b", MAX_ADAPTER_SCALE + 1))), "INVALID_REQUEST", "adapters[1].scale",
     f"use -{MAX_ADAPTER_SCALE} to"),
    (dict(adapters=stack(("a", float("nan")))), "INVALID_REQUEST", "adapters[0].scale", "adapters[0].scale is nan"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "reason", "field", "hint"), BAD_STACKS)
def test_bad_stack_is_refused(fields, reason, field, hint):
    with pytest.raises(InvalidRequestError) as caught:
        RULES.resolve(request(**fields))
    assert (str(caught.value.reason), caught.value.metadata["field"]) == (reason, field)
    assert hint in caught.value.message


def test_a_stack_keeps_its_order_and_fills_in_strengths():
    params = RULES.resolve(request(adapters=stack(("b", -0.5), ("a",), ("c", MAX_ADAPTER_SCALE))))
    assert params.adapters == stack(("b", -0.5), ("a", 1.0), ("c", MAX_ADAPTER_SCALE))
    assert (params.adapter, params.adapter_scale) == ("", 1.0)  # a stack is no single adapter
    full = RULES.resolve(request(adapters=stack(*[(f"a{i}",) for i in range(RULES.max_stack)])))
    assert len(full.adapters) == RULES.max_stack == DEFAULT_MAX_STACK


def test_a_stack_of_one_is_the_single_adapter():
    single = RULES.resolve(request(adapter="a", adapter_scale=0.7, seed=1))
    assert RULES.resolve(request(adapters=stack(("a", 0.7)), seed=1)) == single
    assert (single.adapter, single.adapter_scale, single.adapters) == ("a", 0.7, stack(("a", 0.7)))


def test_max_stack_comes_from_the_rules():
    one = dataclasses.replace(RULES, max_stack=1)
    assert one.resolve(request(adapters=stack(("a",)))).adapter == "a"
    with pytest.raises(InvalidRequestError, match="stacks at most 1"):
        one.resolve(request(adapters=stack(("a",), ("b",))))


def test_a_model_that_ignores_negative_prompts_warns_only_when_one_is_sent():
    ignoring = dataclasses.replace(RULES, ignored_negative_prompt="negative_prompt is ignored: no true CFG")
    assert ignoring.warnings(ignoring.resolve(request(negative_prompt="fog"))) == (
        "negative_prompt is ignored: no true CFG",
    )
    assert ignoring.warnings(ignoring.resolve(request())) == ()
    assert RULES.warnings(RULES.resolve(request(negative_prompt="fog"))) == ()


def test_a_negative_prompt_at_a_guidance_that_does_not_read_it_is_warned_about():
    # SDXL and Qwen-Image read a negative prompt only above guidance 1, Z-Image above 0.
    guided = dataclasses.replace(RULES, negative_prompt_read_above=1.0)
    (warning,) = guided.warnings(guided.resolve(request(negative_prompt="fog", guidance_scale=1.0)))
    assert "ignored at guidance_scale 1" in warning and "above 1" in warning
    assert guided.warnings(guided.resolve(request(negative_prompt="fog", guidance_scale=1.5))) == ()
    assert guided.warnings(guided.resolve(request(guidance_scale=0.0))) == ()


def test_rules_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RULES.max_size = 4096  # type: ignore[misc]


def test_rules_need_no_torch():
    code = (
        "import sys\n"
        "from loraswap.server.engine.request_rules import RequestRules\n"
        "from loraswap.server.engine.types import GenerationRequest, ModelDefaults\n"
        "rules = RequestRules(ModelDefaults(64, 64, 4, 3.5), size_multiple=8, min_size=16, max_size=64)\n"
        "rules.resolve(GenerationRequest(prompt='a boat', width=32))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_scheduler_that_needs_two_steps_refuses_one_by_name():
    # Qwen-Image's terminal-shift stretch divides by zero at one step: the request is refused, not run to NaN.
    rules = dataclasses.replace(RULES, min_steps=2)
    with pytest.raises(InvalidRequestError, match="num_inference_steps is 1; use 2 to ") as refused:
        rules.resolve(GenerationRequest(prompt="a cat", num_inference_steps=1))
    assert refused.value.metadata["field"] == "num_inference_steps"
    assert rules.resolve(GenerationRequest(prompt="a cat", num_inference_steps=2)).num_inference_steps == 2
    assert RULES.resolve(GenerationRequest(prompt="a cat", num_inference_steps=1)).num_inference_steps == 1
