"""Stacks across the proto <-> domain boundary: an unset member scale stays unset, applied stacks travel back."""

from __future__ import annotations

import dataclasses

from loraswap.server.engine.types import (
    GeneratedImage,
    ImageFormat,
    ModelFamily,
    ServerDescription,
    StackedAdapter,
    Timings,
)
from loraswap.server.transport import convert
from loraswap.v1 import diffusion_service_pb2 as pb


def test_request_adapters_keep_their_order_and_unset_scales():
    request = pb.GenerateRequest(
        prompt="a boat",
        adapters=[pb.StackedAdapter(adapter="b", scale=0.5), pb.StackedAdapter(adapter="a")],
    )
    domain = convert.generation_request_from_pb(request)
    assert domain.adapters == (StackedAdapter("b", 0.5), StackedAdapter("a", None))
    assert (domain.adapter, domain.adapter_scale) == ("", None)
    assert convert.generation_request_from_pb(pb.GenerateRequest(prompt="a boat")).adapters == ()


def test_the_applied_stack_goes_back_on_the_image():
    image = GeneratedImage(
        data=b"png", image_format=ImageFormat.PNG, width=8, height=8, seed=1, adapter="", adapter_scale=1.0,
        timings=Timings(), adapters=(StackedAdapter("b", 0.5), StackedAdapter("a", 1.0)),
    )  # fmt: skip
    message = convert.to_pb(image)
    assert [(applied.adapter, applied.scale, applied.HasField("scale")) for applied in message.adapters] == [
        ("b", 0.5, True),
        ("a", 1.0, True),  # the strength applied is always sent, 1.0 included
    ]
    assert message.adapter == ""
    assert list(convert.to_pb(dataclasses.replace(image, adapters=())).adapters) == []


def test_server_info_names_the_resident_stack_and_the_limit():
    info = ServerDescription(
        model="tiny-flux", family=ModelFamily.FLUX, dtype="float32", device="cpu", max_rank=16, target_layers=(),
        compiled=False, recompilations=0, resident_adapter="", size_multiple=4, min_size=8, max_size=64,
        default_width=64, default_height=64, default_num_inference_steps=4, default_guidance_scale=3.5,
        resident_adapters=("a", "b"), max_stack=4,
    )  # fmt: skip
    message = convert.to_pb(info)
    assert (list(message.resident_adapters), message.max_stack, message.resident_adapter) == (["a", "b"], 4, "")
