"""Adapter sources: the name grammar, the adapter directory and the local Hub cache.

Every refusal is checked by exception class and `reason`, since those are what
reach the client. Pickle files hold a payload that creates a marker file when
unpickled, so a source that ever unpickled one would leave the marker behind.
The Hub is a cache laid out by the test in a temp dir with HF_HUB_OFFLINE=1
and sockets refused, exactly as huggingface_hub lays it out after a download.
"""

from __future__ import annotations

import pathlib
import pickle
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file

from loraswap.server.engine.adapters.sources import (
    AdapterFile,
    AdapterSources,
    HubAdapterSource,
    LocalAdapterDirectory,
    check_name,
    parse_hub_ref,
)
from loraswap.server.engine.errors import (
    AdapterFormatError,
    AdapterNameError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    EngineError,
    HubDisabledError,
)

torch.set_num_threads(1)

MAIN_COMMIT = "a" * 40
V1_COMMIT = "b" * 40
MAX_BYTES = 4096
WEIGHTS = "pytorch_lora_weights.safetensors"  # the file a Hub name resolves to when it names none
# What hub_cache holds of owner/name: (commit, file) -> the value the file's tensor is filled with.
CACHED_FILES = {(MAIN_COMMIT, WEIGHTS): 1.0, (MAIN_COMMIT, "style.safetensors"): 2.0, (V1_COMMIT, WEIGHTS): 3.0}


class _TouchWhenUnpickled:
    """Pickles to `Path.touch(marker)`: unpickling it (pickle.load, torch.load) creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(_TouchWhenUnpickled(marker), protocol=4)


def _write_adapter(path: Path, numel: int = 4, fill: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"unet.x.lora_A.weight": torch.full((1, numel), fill)}, str(path))
    return path


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "UNPICKLED"


@pytest.fixture
def adapter_dir(tmp_path: Path, marker: Path) -> Path:
    """An adapter directory with every layout the sources must tell apart, plus a folder outside it."""
    root = tmp_path / "adapters"
    outside = tmp_path / "outside"
    _write_adapter(root / "plain.safetensors")
    _write_adapter(root / "nested" / "deeper" / "style.safetensors")
    _write_adapter(root / "standard" / "pytorch_lora_weights.safetensors", fill=1.0)
    _write_adapter(root / "standard" / "other.safetensors", fill=2.0)
    _write_adapter(root / "single" / "my_lora.safetensors")
    _write_adapter(root / "double" / "a.safetensors")
    _write_adapter(root / "double" / "b.safetensors")
    _write_adapter(root / "big.safetensors", numel=MAX_BYTES)  # 4 bytes per float: over MAX_BYTES
    (root / "empty").mkdir()
    (root / "noext").write_bytes(b"not an adapter")
    _write_adapter(outside / "escaped.safetensors")
    _write_adapter(outside / "pytorch_lora_weights.safetensors")
    (root / "link_out.safetensors").symlink_to(outside / "escaped.safetensors")
    (root / "link_out_dir").symlink_to(outside, target_is_directory=True)
    (root / "link_in.safetensors").symlink_to(root / "plain.safetensors")
    payload = _pickle_payload(marker)
    for name in ("weights.bin", "weights2.pt", "weights3.ckpt", "weights4.pth", "weights5.pkl"):
        (root / name).write_bytes(payload)
    (root / "pickled_folder").mkdir()
    (root / "pickled_folder" / "adapter_model.bin").write_bytes(payload)
    return root


@pytest.fixture
def local_sources(adapter_dir: Path) -> AdapterSources:
    return AdapterSources(LocalAdapterDirectory(adapter_dir, max_adapter_bytes=MAX_BYTES), HubAdapterSource(False))


def test_pickle_payload_is_live(tmp_path: Path) -> None:
    """The pickle files are real hazards: unpickling the payload does create its marker."""
    probe = tmp_path / "probe-marker"
    pickle.loads(_pickle_payload(probe))
    assert probe.exists()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("plain", "plain.safetensors"),
        ("plain.safetensors", "plain.safetensors"),
        ("nested/deeper/style", "nested/deeper/style.safetensors"),
        ("standard", "standard/pytorch_lora_weights.safetensors"),  # the standard name wins over others
        ("standard/other", "standard/other.safetensors"),
        ("single", "single/my_lora.safetensors"),  # the only .safetensors in the folder
        ("double/b", "double/b.safetensors"),
        ("double/a.safetensors", "double/a.safetensors"),
        ("link_in", "plain.safetensors"),  # a symlink that stays inside is fine; the real path is used
    ],
)
def test_local_names_resolve(local_sources: AdapterSources, adapter_dir: Path, name: str, expected: str) -> None:
    found = local_sources.resolve(name)
    # The source callers see is relative to the adapter directory: server paths are not theirs to see.
    assert found == AdapterFile(name=name, path=adapter_dir / expected, source=expected)


@pytest.mark.parametrize(
    ("name", "error", "reason"),
    [
        ("double", AdapterFormatError, "ADAPTER_MALFORMED"),  # two .safetensors: ambiguous
        ("../outside/escaped", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("nested/../plain", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("nested/..", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("./plain", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("nested//deeper/style", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("nested/", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("/etc/passwd", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("/plain", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("nested\\deeper\\style", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("x" * 513, AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("x" * 300, AdapterNameError, "INVALID_ADAPTER_NAME"),  # one file name longer than filesystems allow
        ("nested/" + "x" * 201, AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("hf:owner/" + "r" * 201, AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("has space", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("semi;colon", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("ümlaut", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("link_out", AdapterNameError, "INVALID_ADAPTER_NAME"),  # file symlink leaving the directory
        ("link_out.safetensors", AdapterNameError, "INVALID_ADAPTER_NAME"),
        ("link_out_dir", AdapterNameError, "INVALID_ADAPTER_NAME"),  # folder symlink leaving it
        ("link_out_dir/escaped", AdapterNameError, "INVALID_ADAPTER_NAME"),  # ... and a file through it
        ("weights", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("weights.bin", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("weights2.pt", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("weights2", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("weights3.ckpt", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("weights4.pth", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("weights5.pkl", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("pickled_folder", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("noext", AdapterFormatError, "ADAPTER_MALFORMED"),
        ("big", AdapterTooLargeError, "ADAPTER_TOO_LARGE"),
        ("empty", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("missing", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("nested/missing", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("owner/name", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),  # hub-shaped, hub off: just not here
        ("owner/name@v1", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("owner/name:file.safetensors", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("hf:owner/name", HubDisabledError, "HUB_DISABLED"),
        ("hf:owner/name@v1:file.safetensors", HubDisabledError, "HUB_DISABLED"),
    ],
)
def test_local_refusals(
    local_sources: AdapterSources, marker: Path, name: str, error: type[EngineError], reason: str
) -> None:
    with pytest.raises(error) as raised:
        local_sources.resolve(name)
    assert type(raised.value) is error
    assert raised.value.reason == reason
    assert not marker.exists(), "a pickle file was unpickled"


def test_ambiguous_folder_names_its_files(local_sources: AdapterSources) -> None:
    with pytest.raises(AdapterFormatError, match=r"a\.safetensors, b\.safetensors"):
        local_sources.resolve("double")


def test_too_large_reports_sizes(local_sources: AdapterSources, adapter_dir: Path) -> None:
    with pytest.raises(AdapterTooLargeError) as raised:
        local_sources.resolve("big")
    size = (adapter_dir / "big.safetensors").stat().st_size
    assert raised.value.metadata == {"file_bytes": str(size), "max_bytes": str(MAX_BYTES)}


@pytest.mark.parametrize(("limit", "accepted"), [(0, True), (10**9, True), (MAX_BYTES, False)])
def test_size_limit(adapter_dir: Path, limit: int, accepted: bool) -> None:
    """0 means no limit; a positive limit is checked against the file's size on disk."""
    local = LocalAdapterDirectory(adapter_dir, max_adapter_bytes=limit)
    if accepted:
        assert local.find("big").path == adapter_dir / "big.safetensors"
    else:
        with pytest.raises(AdapterTooLargeError):
            local.find("big")


def test_not_found_names_the_adapter(local_sources: AdapterSources, adapter_dir: Path) -> None:
    with pytest.raises(AdapterNotFoundError) as raised:
        local_sources.resolve("missing")
    assert raised.value.metadata == {"adapter": "missing"}
    assert str(adapter_dir) not in raised.value.message  # callers never see the server's paths


def test_refusals_quote_names_shortened(local_sources: AdapterSources) -> None:
    name = "a;" * 250  # 500 characters of a bad name
    with pytest.raises(AdapterNameError) as raised:
        local_sources.resolve(name)
    assert "a;a;" in raised.value.message and name not in raised.value.message
    assert len(raised.value.message) < 500


def test_a_name_segment_at_the_limit_is_only_looked_up(local_sources: AdapterSources) -> None:
    with pytest.raises(AdapterNotFoundError):
        local_sources.resolve("x" * 200)


def test_no_adapter_directory_finds_nothing(tmp_path: Path) -> None:
    sources = AdapterSources(LocalAdapterDirectory(None), HubAdapterSource(False))
    with pytest.raises(AdapterNotFoundError, match="--adapter-dir"):
        sources.resolve("plain")


@pytest.mark.parametrize(
    ("name", "repo_id", "revision", "weight_name"),
    [
        ("owner/name", "owner/name", None, None),
        ("hf:owner/name", "owner/name", None, None),
        ("hf:owner/name@v1.0", "owner/name", "v1.0", None),
        ("owner/name:lora.safetensors", "owner/name", None, "lora.safetensors"),
        ("hf:owner/name@refs/pr/1:sub/lora.safetensors", "owner/name", "refs/pr/1", "sub/lora.safetensors"),
        ("plain", None, None, None),
        ("a/b/c", None, None, None),
    ],
)
def test_parse_hub_ref(name: str, repo_id: str | None, revision: str | None, weight_name: str | None) -> None:
    ref = parse_hub_ref(name)
    if repo_id is None:
        assert ref is None
    else:
        assert (ref.repo_id, ref.revision, ref.weight_name) == (repo_id, revision, weight_name)


@pytest.mark.parametrize("name", ["plain", "a/b.c/d-e_f", "owner/name@v1:x.safetensors", "hf:owner/name"])
def test_check_name_accepts_grammar(name: str) -> None:
    check_name(name)


# -- the Hub, from a local cache laid out by the test ------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: Path) -> Path:
    """A huggingface_hub cache holding owner/name (main and v1) and owner/pickled; offline, no sockets."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads these once, at import: patch the constants it consults at call time too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)

    repo = cache / "models--owner--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    (repo / "refs" / "v1").write_text(V1_COMMIT)
    for (commit, file), fill in CACHED_FILES.items():
        _write_adapter(repo / "snapshots" / commit / file, fill=fill)
    _write_adapter(repo / "snapshots" / MAIN_COMMIT / "huge.safetensors", numel=MAX_BYTES)
    pickled = cache / "models--owner--pickled"
    (pickled / "refs").mkdir(parents=True)
    (pickled / "refs" / "main").write_text(MAIN_COMMIT)
    (pickled / "snapshots" / MAIN_COMMIT).mkdir(parents=True)
    (pickled / "snapshots" / MAIN_COMMIT / "adapter_model.bin").write_bytes(_pickle_payload(marker))
    return cache


def _hub_sources(root: Path | None, allow_hub: bool = True) -> AdapterSources:
    return AdapterSources(
        LocalAdapterDirectory(root, max_adapter_bytes=MAX_BYTES), HubAdapterSource(allow_hub, MAX_BYTES)
    )


def _fill_of(path: Path) -> float:
    from safetensors.torch import load_file

    (tensor,) = load_file(str(path)).values()
    return float(tensor.flatten()[0])


# Hub name -> the cached file it resolves to (commit, file), and the source reported for it.
HUB_NAMES = {
    "owner/name": (MAIN_COMMIT, WEIGHTS, f"hf://owner/name@main/{WEIGHTS}"),
    "hf:owner/name": (MAIN_COMMIT, WEIGHTS, f"hf://owner/name@main/{WEIGHTS}"),
    "hf:owner/name:style.safetensors": (MAIN_COMMIT, "style.safetensors", "hf://owner/name@main/style.safetensors"),
    "owner/name:style.safetensors": (MAIN_COMMIT, "style.safetensors", "hf://owner/name@main/style.safetensors"),
    "hf:owner/name@v1": (V1_COMMIT, WEIGHTS, f"hf://owner/name@v1/{WEIGHTS}"),
    f"owner/name@v1:{WEIGHTS}": (V1_COMMIT, WEIGHTS, f"hf://owner/name@v1/{WEIGHTS}"),
    f"hf:owner/name@{V1_COMMIT}": (V1_COMMIT, WEIGHTS, f"hf://owner/name@{V1_COMMIT}/{WEIGHTS}"),
}


@pytest.mark.parametrize("name", list(HUB_NAMES))
def test_hub_names_resolve_from_cache(hub_cache: Path, tmp_path: Path, name: str) -> None:
    commit, file, source = HUB_NAMES[name]
    found = _hub_sources(tmp_path / "no-such-dir").resolve(name)
    assert found.name == name
    assert found.path.resolve() == (hub_cache / "models--owner--name" / "snapshots" / commit / file).resolve()
    assert found.source == source
    assert _fill_of(found.path) == CACHED_FILES[(commit, file)]


def test_adapter_directory_wins_over_hub(hub_cache: Path, tmp_path: Path) -> None:
    """A local folder named like a repo shadows the Hub unless the name says hf: explicitly."""
    root = tmp_path / "adapters"
    _write_adapter(root / "owner" / "name.safetensors", fill=9.0)
    sources = _hub_sources(root)
    assert _fill_of(sources.resolve("owner/name").path) == 9.0
    assert _fill_of(sources.resolve("hf:owner/name").path) == 1.0


@pytest.mark.parametrize(
    ("name", "error", "reason"),
    [
        ("hf:owner/missing", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("owner/missing", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("hf:owner/name@v2", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("hf:owner/name:absent.safetensors", AdapterNotFoundError, "ADAPTER_NOT_FOUND"),
        ("hf:owner/name:huge.safetensors", AdapterTooLargeError, "ADAPTER_TOO_LARGE"),
        ("hf:owner/name:adapter_model.bin", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        ("hf:owner/pickled", AdapterFormatError, "ADAPTER_PICKLE_REFUSED"),
        pytest.param(
            "hf:../escape", AdapterNameError, "INVALID_ADAPTER_NAME",
        ),
        pytest.param(
            "hf:owner/..", AdapterNameError, "INVALID_ADAPTER_NAME",
        ),
        pytest.param(
            "hf:owner/name:../../escape.safetensors", AdapterNameError, "INVALID_ADAPTER_NAME",
        ),
        pytest.param(
            "owner/name@../../escape", AdapterNameError, "INVALID_ADAPTER_NAME",
        ),
        pytest.param(
            "hf:not a name!", AdapterNameError, "INVALID_ADAPTER_NAME",
        ),
        pytest.param(
            "hf:", AdapterNameError, "INVALID_ADAPTER_NAME",
        ),
    ],
)  # fmt: skip
def test_hub_refusals(
    hub_cache: Path, tmp_path: Path, marker: Path, name: str, error: type[EngineError], reason: str
) -> None:
    with pytest.raises(EngineError) as raised:
        _hub_sources(tmp_path / "no-such-dir").resolve(name)
    assert type(raised.value) is error
    assert raised.value.reason == reason
    assert not marker.exists(), "a pickle file was unpickled"


def test_hub_revision_cannot_leave_the_repo_cache(hub_cache: Path, tmp_path: Path) -> None:
    """`@../../planted` makes huggingface_hub read <cache>/planted as the ref: a path outside the repo's folder."""
    (hub_cache / "planted").write_text(V1_COMMIT)
    with pytest.raises(AdapterNameError):
        _hub_sources(None).resolve("owner/name@../../planted")


@pytest.mark.parametrize(
    ("name", "has_card"),
    [("owner/name", True), ("owner/name:style.safetensors", True), ("owner/name@v1", False)],
)
def test_hub_adapters_bring_their_repos_model_card(hub_cache: Path, tmp_path: Path, name: str, has_card: bool) -> None:
    """The repo's README.md (where a base model may be declared) comes from the same cache, offline; none is none."""
    card_text = "---\nbase_model: black-forest-labs/FLUX.1-dev\n---\n"
    (hub_cache / "models--owner--name" / "snapshots" / MAIN_COMMIT / "README.md").write_text(card_text)
    found = _hub_sources(tmp_path / "no-such-dir").resolve(name)
    if has_card:
        assert found.model_card is not None and found.model_card.read_text() == card_text
    else:
        assert found.model_card is None
