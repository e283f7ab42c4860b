"""The hostile-input catalogue: bad input tried from outside, through a real server, one named case each.

Every case gets a specific status (never UNKNOWN or INTERNAL) and ErrorInfo reason, a message that says what to
change, bounded in size and free of server paths; afterwards the server keeps serving and the base model's image
(and a good adapter's) is bit-identical to the one taken before the whole catalogue ran.

The catalogue grows: for every new case found, add a `HostileCase` to `CASES` (and any file it needs to
`_write_hostile_files`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from loraswap.client import AsyncLoraswapClient, LoraswapError
from loraswap.server.devtools.random_adapter import write_random_adapter
from loraswap.server.engine.models import builtin_model
from tests.support.servers import client_of, serving

pytestmark = pytest.mark.asyncio(loop_scope="session")

GOOD = "good"
WEIGHTS = "pytorch_lora_weights.safetensors"
BASE = dict(prompt="a boat", seed=4, num_inference_steps=2)
# What the engine bounds messages and echoed values to (engine/errors.py); gRPC caps all headers at 16 KiB.
MAX_MESSAGE_CHARS = 2000
MAX_ECHO_CHARS = 200
# Every case must answer well within this, however much work its file asks for.
CASE_TIMEOUT_S = 60
KOHYA_MODULE = "lora_unet_double_blocks_0_img_attn_proj"  # a 32 -> 32 layer of tiny-flux
DIFFUSERS_MODULE = "transformer.transformer_blocks.0.attn.to_q"  # 32 -> 32 as well
HUGE = "k" * 20_000  # a name or key whose echo alone would overflow gRPC's 16 KiB of headers


@dataclass(frozen=True)
class Target:
    """What a case attacks: a client of the catalogue's server and the server's adapter directory."""

    client: AsyncLoraswapClient
    adapter_dir: Path


@dataclass(frozen=True)
class HostileCase:
    """One hostile input: what to try, and the status, reason and advice it must get (code None: it is served)."""

    name: str
    attempt: Callable[[Target], Awaitable[object]]
    code: grpc.StatusCode | None
    reason: str = ""
    hint: str = ""


def _generate(adapter: str, **overrides) -> Callable[[Target], Awaitable[object]]:
    return lambda target: target.client.generate_image(**{**BASE, "adapter": adapter, **overrides})


def _preload(adapter: str) -> Callable[[Target], Awaitable[object]]:
    return lambda target: target.client.preload_adapter(adapter)


def _evict(adapter: str) -> Callable[[Target], Awaitable[object]]:
    return lambda target: target.client.evict(adapter)


# -- files changed after they were cached ------------------------------------------------------------------


def _nan_bytes(path: Path) -> bytes:
    """The file's own header and tensors with a NaN in each: the same size, so it can be written in place."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = {key: value.clone() for key, value in load_file(str(path)).items()}
    for value in tensors.values():
        value[0, 0] = float("nan")
    data = save(tensors, metadata=metadata)
    assert len(data) == path.stat().st_size
    return data


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _rewrite_in_place_with_nan(path: Path) -> None:
    data = _nan_bytes(path)
    with open(path, "r+b") as handle:  # the same inode: what a mapping of the old file would see
        handle.write(data)


def _changed_after_caching(adapter: str, change: Callable[[Path], None]) -> Callable[[Target], Awaitable[object]]:
    """Cache the adapter, change its file: it is served as validated until evicted, then the file is read anew."""

    async def attempt(target: Target) -> object:
        await target.client.preload_adapter(adapter)
        before = await target.client.generate_image(**BASE, adapter=adapter)
        change(target.adapter_dir / adapter / WEIGHTS)
        await target.client.generate_image(**BASE)  # the slot changes away: the next use copies the adapter in anew
        served = await target.client.generate_image(**BASE, adapter=adapter)
        assert served.data == before.data, "the cache must serve the bytes it validated, not the changed file"
        await target.client.evict(adapter)
        return await target.client.generate_image(**BASE, adapter=adapter)

    return attempt


# -- the files the cases name -------------------------------------------------------------------------------


def _write_hostile_files(root: Path) -> None:
    flux = builtin_model("tiny-flux").build()
    good_file = write_random_adapter(flux, root / GOOD, rank=4, seed=1, init_std=0.5)
    for copy in ("victim-truncated", "victim-nan", "slow", "fast"):
        shutil.copytree(root / GOOD, root / copy)
    with safe_open(str(good_file), framework="pt") as handle:
        header = handle.metadata()
    tensors = load_file(str(good_file))
    lora_config = json.loads(header["lora_adapter_metadata"])

    def write(name: str, tensors: dict, metadata: dict | None = None) -> None:
        save_file(tensors, root / f"{name}.safetensors", metadata=metadata)

    def write_metadata(name: str, raw: str | None = None, **changes) -> None:
        edited = {**lora_config, **{f"transformer.{key}": value for key, value in changes.items()}}
        write(name, tensors, {**header, "lora_adapter_metadata": raw if raw is not None else json.dumps(edited)})

    # Metadata is untrusted: patterns PEFT would run as regular expressions, wrong types, floods, deep nesting.
    write_metadata("meta-backtracking-pattern", alpha_pattern={"([a-z_.0-9]|[a-z_.0-9])*Z": 2.0})
    write_metadata("meta-malformed-pattern", alpha_pattern={"to_q(": 2.0})
    write_metadata("meta-pattern-flood", alpha_pattern={f"block{i}.to_q": 2.0 for i in range(5000)})
    write_metadata("meta-wrong-type", lora_alpha="very strong")
    write_metadata("meta-pattern-not-a-dict", rank_pattern=["to_q", 8])
    write_metadata("meta-deep-json", raw="[" * 100_000 + "]" * 100_000)
    # PEFT itself raised ImportError for this one (LoftQ needs scipy), which ended as INTERNAL.
    write_metadata("meta-unknown-init-option", init_lora_weights="loftq", loftq_config={"bits": "x"})

    # Degenerate tensors, in diffusers and kohya layouts.
    write(
        "rank0-diffusers",
        {
            f"{DIFFUSERS_MODULE}.lora_A.weight": torch.zeros(0, 32),
            f"{DIFFUSERS_MODULE}.lora_B.weight": torch.zeros(32, 0),
        },
    )
    write(
        "rank0-kohya",
        {
            f"{KOHYA_MODULE}.lora_down.weight": torch.zeros(0, 32),
            f"{KOHYA_MODULE}.lora_up.weight": torch.zeros(32, 0),
            f"{KOHYA_MODULE}.alpha": torch.tensor(4.0),
        },
    )
    write(
        "scalar-diffusers",
        {
            f"{DIFFUSERS_MODULE}.lora_A.weight": torch.tensor(1.0),
            f"{DIFFUSERS_MODULE}.lora_B.weight": torch.tensor(1.0),
        },
    )
    write(
        "scalar-kohya",
        {
            f"{KOHYA_MODULE}.lora_down.weight": torch.tensor(1.0),
            f"{KOHYA_MODULE}.lora_up.weight": torch.tensor(1.0),
            f"{KOHYA_MODULE}.alpha": torch.tensor(4.0),
        },
    )

    # Keys whose echo would overflow the headers.
    write(
        "huge-layer-name",
        {
            **tensors,
            f"transformer.{HUGE}.lora_A.weight": torch.ones(4, 32),
            f"transformer.{HUGE}.lora_B.weight": torch.ones(32, 4),
        },
    )
    write("huge-extra-tensor", {**tensors, f"transformer.{HUGE}.bias": torch.ones(4)})

    # Finite factors (every check passes) whose product overflows float32 inside the model.
    overflow = {key: torch.full_like(value, 1e30) for key, value in tensors.items()}
    write("overflowing", overflow, header)


CASES = [
    # Files that change after they were cached.
    HostileCase("cached-file-truncated", _changed_after_caching("victim-truncated", _truncate),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_MALFORMED", "re-export"),
    HostileCase("cached-file-rewritten-in-place-with-nan",
                _changed_after_caching("victim-nan", _rewrite_in_place_with_nan),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_NOT_FINITE", "NaN"),
    # Adapter metadata is untrusted.
    HostileCase("metadata-backtracking-pattern", _preload("meta-backtracking-pattern"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_METADATA", "never regular expressions"),
    HostileCase("metadata-malformed-pattern", _generate("meta-malformed-pattern"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_METADATA", "must be module names"),
    HostileCase("metadata-pattern-flood", _preload("meta-pattern-flood"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_METADATA", "at most 1024"),
    HostileCase("metadata-wrong-type", _generate("meta-wrong-type"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_METADATA", "must be a number"),
    HostileCase("metadata-pattern-not-a-dict", _preload("meta-pattern-not-a-dict"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_METADATA", "map module names"),
    HostileCase("metadata-nested-too-deep", _preload("meta-deep-json"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_BAD_METADATA", "re-save"),
    # Training-only settings never reach PEFT: an init option it does not know changes nothing at inference.
    HostileCase("metadata-unknown-init-option", _generate("meta-unknown-init-option"), None),
    # Degenerate tensors.
    HostileCase("rank-0-diffusers", _generate("rank0-diffusers"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_SHAPE_MISMATCH", "rank of at least 1"),
    HostileCase("rank-0-kohya", _preload("rank0-kohya"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_SHAPE_MISMATCH", "rank of at least 1"),
    HostileCase("0-dimensional-diffusers", _generate("scalar-diffusers"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_SHAPE_MISMATCH", "only alpha values may be scalars"),
    HostileCase("0-dimensional-kohya", _preload("scalar-kohya"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_SHAPE_MISMATCH", "only alpha values may be scalars"),
    # Names, and messages that would echo too much or reveal the server's paths.
    HostileCase("name-of-20k-characters", _generate(HUGE),
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "limited to 512"),
    HostileCase("preload-name-of-20k-characters", _preload(HUGE),
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "limited to 512"),
    HostileCase("evict-name-of-20k-characters", _evict(HUGE),
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "limited to 512"),
    HostileCase("name-segment-too-long-for-the-filesystem", _generate("dir/" + "s" * 300),
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "limited to 200"),
    HostileCase("bad-characters-in-a-long-name", _generate("a b/" * 120 + "x"),
                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", "use letters, digits"),
    HostileCase("unknown-adapter-reveals-no-path", _generate("no/such/adapter"),
                grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", "under the adapter directory"),
    HostileCase("layer-name-of-20k-characters", _preload("huge-layer-name"),
                grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_LAYER_NOT_TARGETED", "--target-modules"),
    HostileCase("tensor-key-of-20k-characters", _generate("huge-extra-tensor"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_UNSUPPORTED_TENSORS", "not plain LoRA factors"),
    # Finite factors whose change is not (1e30 x 1e30): refused where the file loads, before any merge or step.
    HostileCase("adapter-output-overflows", _generate("overflowing"),
                grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_OUT_OF_RANGE", "no strength"),
]  # fmt: skip


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    _write_hostile_files(root)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(hostile_dir):
    async with serving("tiny-flux", hostile_dir) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def images_before(server) -> tuple[bytes, bytes]:
    """The base model's and the good adapter's images, taken before any case ran."""
    async with client_of(server) as client:
        base = await client.generate_image(**BASE)
        good = await client.generate_image(**BASE, adapter=GOOD)
    assert base.data != good.data
    return base.data, good.data


def _assert_well_formed(error: LoraswapError, adapter_dir: Path) -> None:
    """Bounded, path-free, and specific: what every refusal from outside must be."""
    assert error.code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), error
    assert error.reason, error
    assert len(error.message) <= MAX_MESSAGE_CHARS, len(error.message)
    assert all(len(value) <= MAX_ECHO_CHARS for value in error.metadata.values()), error.metadata
    shown = error.message + " ".join(error.metadata.values())
    assert str(adapter_dir.parent) not in shown, f"a server path leaked: {error.message}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_hostile_input(client, server, hostile_dir, images_before, case: HostileCase):
    target = Target(client=client, adapter_dir=hostile_dir)
    if case.code is None:
        await asyncio.wait_for(case.attempt(target), CASE_TIMEOUT_S)
    else:
        with pytest.raises(LoraswapError) as caught:
            await asyncio.wait_for(case.attempt(target), CASE_TIMEOUT_S)
        error = caught.value
        _assert_well_formed(error, hostile_dir)
        assert (error.code, error.reason) == (case.code, case.reason), error
        assert case.hint in error.message, error.message

    base, good = images_before
    assert (await client.generate_image(**BASE)).data == base
    assert (await client.generate_image(**BASE, adapter=GOOD)).data == good
    assert (await client.server_info()).recompilations == 0


async def test_the_catalogue_names_each_case_once():
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))


async def test_a_slow_adapter_load_does_not_hold_up_another(client, server, monkeypatch):
    """One adapter's source hangs (a slow disk or Hub); another adapter still loads at once."""
    sources = server.engine.sources
    resolve = sources.resolve
    entered, release = threading.Event(), threading.Event()

    def slow_resolve(name: str, link: str | None = None):
        if name == "slow":
            entered.set()
            release.wait(CASE_TIMEOUT_S)
        return resolve(name, link)

    monkeypatch.setattr(sources, "resolve", slow_resolve)
    slow = asyncio.ensure_future(client.preload_adapter("slow"))
    try:
        assert await asyncio.to_thread(entered.wait, CASE_TIMEOUT_S)
        started = time.perf_counter()
        fast = await asyncio.wait_for(client.preload_adapter("fast"), CASE_TIMEOUT_S / 2)
        assert not fast.already_cached and time.perf_counter() - started < CASE_TIMEOUT_S / 2
        assert not slow.done(), "the slow load was meant to be still running"
        image = await client.generate_image(**BASE, adapter="fast")
        assert image.adapter == "fast"
    finally:
        release.set()
    assert not (await slow).already_cached
