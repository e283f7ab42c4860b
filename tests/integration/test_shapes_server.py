"""The `shapes` model and its demo adapters, served: pictures that follow the prompt, adapters that visibly restyle.

One compiled server draws the prompt set in the sequence base -> outline ->
swap-colors -> base -> purple; the pixel classifier reads every picture.  The
thresholds are the issue's: base >= 90% right on shape, color and background;
swap-colors >= 95% exchanged; outline >= 85% hollow in the right color;
purple >= 90% purple shapes; no recompilation across the swaps.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from training.shapes_classifier import ShapeReading, classify_image
from training.shapes_data import prompt_set

from loraswap.client import AsyncLoraswapClient
from loraswap.server.engine.models.shapes import shapes_adapter_dir
from tests.support.images import decode
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Every third prompt: 30 prompts, each shape 10 times, every color as shape and as background.
PROMPTS = prompt_set()[::3]
SEED = 1000
SEQUENCE = ("", "outline", "swap-colors", "", "purple")


async def draw_all(client: AsyncLoraswapClient, adapter: str) -> list[tuple[ShapeReading, bytes]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        image = await client.generate_image(prompt.text, adapter=adapter, seed=SEED + i)
        assert image.adapter == adapter
        out.append((classify_image(decode(image.data).astype("uint8")), image.data))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sequence_results():
    """Readings of each phase of SEQUENCE, and the server's recompilation count before and after."""
    async with serving("shapes", shapes_adapter_dir()) as running, client_of(running) as client:
        info = await client.server_info()
        phases = [(adapter, await draw_all(client, adapter)) for adapter in SEQUENCE]
        after = await client.server_info()
    return info, after, phases


def share(readings, predicate) -> float:
    return sum(predicate(reading, prompt) for (reading, _), prompt in zip(readings, PROMPTS, strict=True)) / len(
        PROMPTS
    )


def phase(results, adapter: str, occurrence: int = 0):
    return [readings for name, readings in results[2] if name == adapter][occurrence]


async def test_server_defaults_come_from_the_model(sequence_results) -> None:
    info, _, _ = sequence_results
    assert info.model == "shapes" and info.compiled
    assert (info.default_width, info.default_height) == (64, 64)


async def test_base_draws_what_the_prompt_says(sequence_results) -> None:
    right = share(phase(sequence_results, ""), lambda r, p: r.matches(p.shape, p.color, p.background))
    assert right >= 0.90


async def test_swap_colors_exchanges_shape_and_background_colors(sequence_results) -> None:
    right = share(
        phase(sequence_results, "swap-colors"), lambda r, p: r.color == p.background and r.background == p.color
    )
    assert right >= 0.95


async def test_outline_draws_hollow_shapes_in_the_right_color(sequence_results) -> None:
    right = share(phase(sequence_results, "outline"), lambda r, p: r.hollow and r.color == p.color)
    assert right >= 0.85


async def test_purple_draws_a_color_the_base_never_does(sequence_results) -> None:
    base_purple = share(phase(sequence_results, ""), lambda r, p: r.color == "purple")
    adapter_purple = share(phase(sequence_results, "purple"), lambda r, p: r.color == "purple")
    assert base_purple == 0 and adapter_purple >= 0.90


async def test_swaps_need_no_recompilation_and_base_comes_back_unchanged(sequence_results) -> None:
    before, after, _ = sequence_results
    assert before.recompilations == 0 and after.recompilations == 0
    first, again = phase(sequence_results, "", 0), phase(sequence_results, "", 1)
    # Same seeds, same prompts: the base model after three adapters draws the very same pictures.
    unchanged = [a == b for (_, a), (_, b) in zip(first, again, strict=True)]
    assert all(unchanged), f"{unchanged.count(False)} of {len(unchanged)} base pictures changed after the swaps"
