"""Queue bound, positions, adapter-aware order, cancellation, deadlines, readiness (real server, real clients)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraswap.client import GeneratedImage, LoraswapError, Progress, Queued
from tests.support.servers import address_of, client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

LONG_STEPS = 150  # long enough (> 0.5 s on one thread) to hold the worker while others queue


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(flux_adapter_dir):
    async with serving("tiny-flux", flux_adapter_dir, compile=False, max_queue=3, max_bypass=2) as running:
        yield running


async def wait_until_running(client, **request):
    """Start a long generation and return (task, first-progress event) once it holds the worker."""
    started = asyncio.Event()

    async def run():
        events = []
        async for event in client.generate("a long one", num_inference_steps=LONG_STEPS, **request):
            events.append(event)
            if isinstance(event, Progress):
                started.set()
        return events

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(started.wait(), 30)
    return task


async def queued_positions(server) -> int:
    return server.engine.gauges().queue_depth


async def test_full_queue_is_refused_at_once_and_the_queued_finish(client, server):
    holder = await wait_until_running(client, seed=1)
    waiting = [asyncio.ensure_future(client.generate_image("queued", seed=seed, num_inference_steps=2))
               for seed in range(3)]  # fmt: skip
    while await queued_positions(server) < 3:
        await asyncio.sleep(0.01)
    started = time.perf_counter()
    with pytest.raises(LoraswapError) as caught:
        await client.generate_image("one too many", seed=9, num_inference_steps=2)
    assert time.perf_counter() - started < 0.5 and not holder.done()
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    assert caught.value.retry_after_s is not None and "max-queue" in caught.value.message
    images = await asyncio.gather(*waiting)
    assert [image.seed for image in images] == [0, 1, 2]
    assert isinstance((await holder)[-1], GeneratedImage)


async def test_cancel_while_queued_leaves_the_queue_at_once(client, server):
    holder = await wait_until_running(client, seed=1)
    doomed = asyncio.ensure_future(client.generate_image("doomed", seed=2, num_inference_steps=2))
    behind_positions: list[int] = []

    async def behind():
        async for event in client.generate("behind", seed=3, num_inference_steps=2):
            if isinstance(event, Queued):
                behind_positions.append(event.position)
            if isinstance(event, GeneratedImage):
                return event

    behind_task = asyncio.ensure_future(behind())
    while behind_positions != [2]:
        await asyncio.sleep(0.01)
    doomed.cancel()
    while behind_positions[-1] != 1:
        await asyncio.sleep(0.01)
    assert not holder.done(), "the position changed because the doomed request left, not because work finished"
    assert await queued_positions(server) == 1
    await holder
    assert (await behind_task).seed == 3


async def test_cancel_mid_generation_frees_the_worker_within_a_step(client):
    reference = await client.generate_image("next", seed=5, num_inference_steps=3)
    events = []

    async def abandoned():
        async for event in client.generate("abandon me", seed=4, num_inference_steps=LONG_STEPS):
            events.append(event)

    task = asyncio.ensure_future(abandoned())
    while not any(isinstance(event, Progress) and event.step >= 3 for event in events):
        await asyncio.sleep(0.005)
    step_ms = max(event.elapsed_ms / event.step for event in events if isinstance(event, Progress))
    following = asyncio.ensure_future(client.generate_image("next", seed=5, num_inference_steps=3))
    await asyncio.sleep(0.05)
    task.cancel()
    cancelled_at = time.perf_counter()
    image = await following
    waited_ms = (time.perf_counter() - cancelled_at) * 1000
    last_step = max(event.step for event in events if isinstance(event, Progress))
    assert last_step < LONG_STEPS
    # The next request ran after at most one more step of the abandoned one (plus its own work). Its own work is
    # total_ms less its queue wait: the wait is what is measured here.
    own_ms = image.timings.total_ms - image.timings.queue_ms
    assert waited_ms < 2 * step_ms + own_ms + 250, (waited_ms, step_ms, own_ms)
    assert image.data == reference.data


async def test_deadline_ends_with_deadline_exceeded_and_the_worker_moves_on(client):
    reference = await client.generate_image("after", seed=6, num_inference_steps=3)
    with pytest.raises(LoraswapError) as caught:
        await client.generate_image("too slow", seed=7, num_inference_steps=LONG_STEPS, timeout=0.3)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    started = time.perf_counter()
    after = await client.generate_image("after", seed=6, num_inference_steps=3)
    assert after.data == reference.data
    assert after.timings.queue_ms < 500 and time.perf_counter() - started < 5


async def queue_base_behind_resident_adapter(client):
    """While an r4-attn request runs, queue a base-model request, then two r4-attn ones.

    Returns the running request, the queued tasks, the labels in finishing order, and `submit`
    to queue more (label, adapter) requests the same way.
    """
    holder = await wait_until_running(client, seed=1, adapter="r4-attn")
    finished: list[str] = []

    async def one(label, adapter):
        await client.generate_image("order", seed=8, adapter=adapter, num_inference_steps=2)
        finished.append(label)

    def submit(label, adapter):
        tasks.append(asyncio.ensure_future(one(label, adapter)))

    tasks: list[asyncio.Future] = []
    submit("base", "")
    await asyncio.sleep(0.05)
    for index in range(2):
        submit(f"r4-{index}", "r4-attn")
        await asyncio.sleep(0.05)
    return holder, tasks, finished, submit


async def test_waiting_requests_for_the_resident_adapter_go_first_but_never_starve(client):
    """max_bypass=2: a base-model request behind the resident adapter's is passed over at most twice."""
    holder, tasks, finished, _ = await queue_base_behind_resident_adapter(client)
    assert not holder.done()
    await asyncio.gather(*tasks)
    await holder
    # Both resident-adapter requests jumped the base one (2 bypasses, the limit): order r4, r4, base.
    assert finished == ["r4-0", "r4-1", "base"]


async def test_bypass_limit_holds_under_adversarial_arrivals(client, server):
    """A stream of resident-adapter requests cannot starve a base request beyond max_bypass."""
    engine = server.engine
    holder, tasks, finished, submit = await queue_base_behind_resident_adapter(client)
    # Keep feeding resident-adapter requests as soon as there is room in the queue.
    for index in range(2, 6):
        while engine.gauges().queue_depth >= engine.config.max_queue:
            await asyncio.sleep(0.005)
        submit(f"r4-{index}", "r4-attn")
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    await holder
    assert finished.index("base") <= engine.config.max_bypass


async def test_a_resident_stack_is_one_state_its_members_in_any_order_go_first(client, server):
    """A stack in the slot lets requests for the same members, in another order, go ahead with no swap."""
    holder = await wait_until_running(client, seed=1, adapters=[("r4-attn", 1.0), ("r8-context", 0.5)])
    swaps = server.engine.swaps
    finished: list[str] = []

    async def one(label, adapters):
        await client.generate_image("order", seed=8, adapters=adapters, num_inference_steps=2)
        finished.append(label)

    tasks = [asyncio.ensure_future(one("base", []))]
    await asyncio.sleep(0.05)
    for index in range(2):
        tasks.append(asyncio.ensure_future(one(f"stack-{index}", [("r8-context", 0.5), ("r4-attn", 1.0)])))
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    await holder
    assert finished == ["stack-0", "stack-1", "base"]
    assert server.engine.swaps - swaps == 1  # only the base request swapped


async def test_not_serving_while_warming_up_and_wait_for_ready_clients_wait(flux_adapter_dir, monkeypatch):
    # The warm-up is held until the checks below have run, so that they see it under way however fast it would be.
    from loraswap.server.engine.pipeline import startup

    warm_up, release = startup.warm_up, threading.Event()

    def held_warm_up(*args, **kwargs):
        release.wait(120)
        return warm_up(*args, **kwargs)

    monkeypatch.setattr(startup, "warm_up", held_warm_up)
    async with serving("tiny-flux", flux_adapter_dir, compile=False, wait_until_serving=False) as running:
        try:
            async with grpc.aio.insecure_channel(address_of(running)) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            async with client_of(running, wait_for_ready=False, default_timeout=5) as impatient:
                with pytest.raises(LoraswapError) as caught:
                    await impatient.generate_image("too early", seed=1)
            assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAVAILABLE, "NOT_SERVING")
            async with client_of(running) as patient:
                waiting = asyncio.ensure_future(patient.generate_image("worth the wait", seed=1, num_inference_steps=2))
                await asyncio.sleep(1.0)
                assert not waiting.done() and not running.warming.done(), "the patient client was meant to be waiting"
                release.set()
                image = await waiting
            assert running.warming.done() and image.data
        finally:
            release.set()  # before the stop, which would wait for the held warm-up
