"""Adapters from https:// URLs, against a real nginx (TLS with a CA made here) and small hostile servers.

Each refusal is checked for its code and reason, for a message that names the URL's identity and never its
query, for nothing left in either cache (ListAdapters, the disk cache's files), for the model left as it was,
and, for the slow ones, for the server serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import socket
import ssl
import threading
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from loraswap.client import LoraswapError, Queued
from loraswap.server.engine.models import BUILTINS
from tests.integration.test_metrics import scrape, scrape_text
from tests.support.certificates import TestCertificateAuthority
from tests.support.servers import client_of, serving
from tests.support.web_servers import HostileHttpServer, NginxFileServer, closed_port_url, require_nginx

require_nginx()

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "a red circle on a blue background"
STEPS = 2
# A presigned link's signing parameters: what must never be seen anywhere.
SECRET = "SIGNATURE-THAT-MUST-NOT-LEAK"
SIGNED = f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=300&X-Amz-Signature={SECRET}"
MAX_ADAPTER_BYTES = 1_000_000
TIMEOUT_S = 2.0
DEADLINE_S = 4.0
SHIPPED = ("outline", "purple", "swap-colors")


def _shipped(name: str) -> Path:
    return BUILTINS["shapes"].adapter_dir / name / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """What nginx serves: the shapes model's adapters under several names, and files that are no adapter."""
    root = tmp_path_factory.mktemp("served")
    for name in SHIPPED:
        for copy in ("", "-2", "-3", "-4", "-5", "-6"):
            shutil.copyfile(_shipped(name), root / f"{name}{copy}.safetensors")
    (root / "page.html").write_text("<!doctype html><title>sign in</title>" * 50)
    (root / "large.safetensors").write_bytes(_shipped("outline").read_bytes() * 3)  # over MAX_ADAPTER_BYTES
    # A safetensors file of a LoRA for no layer of this model: it downloads whole, then fails to load.
    import torch
    from safetensors.torch import save_file

    save_file({"unet.nowhere.lora_A.weight": torch.zeros(4, 8), "unet.nowhere.lora_B.weight": torch.zeros(8, 4)},
              root / "foreign.safetensors")  # fmt: skip
    return root


@pytest.fixture(scope="module")
def ca() -> TestCertificateAuthority:
    return TestCertificateAuthority("loraswap URL test CA")


@pytest.fixture(scope="module")
def web(files, ca):
    with NginxFileServer(files, ca, token="private-token") as server:
        yield server


@pytest.fixture(scope="module")
def untrusted_web(files):
    """The same files behind a certificate of a CA the servers do not trust."""
    with NginxFileServer(files, TestCertificateAuthority("someone else's CA")) as server:
        yield server


def _url_settings(web, cache_dir: Path, **options) -> dict:
    return dict(
        compile="none",
        allow_url_host=("127.0.0.1", "localhost", "*.invalid"),
        allow_insecure_url_host=("127.0.0.1",),
        url_ca_file=web.ca_file,
        adapter_cache_dir=cache_dir,
        max_adapter_bytes=MAX_ADAPTER_BYTES,
        url_timeout_seconds=TIMEOUT_S,
        url_deadline_seconds=DEADLINE_S,
        metrics_port=0,
        **options,
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("download-cache")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(web, cache_dir):
    """Hosts 127.0.0.1 (https and http) and localhost, no private addresses for names, no tokens."""
    async with serving("shapes", None, **_url_settings(web, cache_dir)) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def client(server):
    async with client_of(server) as connected:
        yield connected


def _disk(cache_dir: Path) -> tuple[set[str], list[str]]:
    """The disk cache's content files (their hashes) and whatever partial downloads it holds."""
    return {path.stem for path in (cache_dir / "sha256").glob("*")}, [p.name for p in (cache_dir / "partial").glob("*")]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def _listed(client) -> set[str]:
    return {adapter.id for adapter in (await client.list_adapters()).adapters}


async def test_a_presigned_url_gives_its_files_image_and_never_shows_its_query(client, web, cache_dir, caplog):
    caplog.set_level(logging.DEBUG)
    url = web.url("/files/outline.safetensors") + SIGNED
    identity = web.url("/files/outline.safetensors")
    local = await client.generate_image(PROMPT, adapter="outline", seed=3, num_inference_steps=STEPS)
    events = [event async for event in client.generate(PROMPT, adapter=url, seed=3, num_inference_steps=STEPS)]
    image = events[-1]
    assert image.data == local.data
    assert [entry.adapter for entry in image.adapters] == [identity]
    assert isinstance(events[0], Queued) and events[0].loading_adapter
    assert image.timings.adapter_load_ms > 0
    listing = await client.list_adapters()
    entry = next(adapter for adapter in listing.adapters if adapter.id == identity)
    assert entry.source == f"{identity} sha256:{_sha256(_shipped('outline'))}"
    assert _sha256(_shipped("outline")) in _disk(cache_dir)[0]
    assert SECRET not in str(listing) and SECRET not in str(image.adapters)
    # The next link to the same object, signed anew, is the same adapter: no download, the same bytes.
    served_before = web.requests("/files/outline.safetensors")
    again = await client.generate_image(
        PROMPT, adapter=url.replace(SECRET, "ANOTHER-SIGNATURE"), seed=3, num_inference_steps=STEPS
    )
    assert again.data == local.data and again.timings.adapter_load_ms == 0
    assert web.requests("/files/outline.safetensors") == served_before
    assert not [record for record in caplog.records if SECRET in record.getMessage()]


async def test_no_metric_or_log_line_holds_a_query(server, client, web, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(LoraswapError):
        await client.generate_image(PROMPT, adapter=web.url("/status/503") + SIGNED, num_inference_steps=STEPS)
    await client.generate_image(PROMPT, adapter=web.url("/files/outline.safetensors") + SIGNED, num_inference_steps=1)
    assert SECRET not in await scrape_text(server.metrics_port)
    assert not [record for record in caplog.records if SECRET in record.getMessage()]


async def test_concurrent_requests_for_one_url_share_one_download(client, web):
    path = "/files/purple-2.safetensors"
    local = await client.generate_image(PROMPT, adapter="purple", seed=5, num_inference_steps=STEPS)
    images = await asyncio.gather(
        *(
            client.generate_image(PROMPT, adapter=web.url(path) + f"?X-Amz-Signature=s{i}", seed=5,
                                  num_inference_steps=STEPS)
            for i in range(4)
        )
    )  # fmt: skip
    assert all(image.data == local.data for image in images)
    assert web.requests(path) == 1


async def test_preload_reports_the_download_and_a_revalidation_sends_no_body(client, web):
    url = web.url("/files/swap-colors-2.safetensors")
    first = await client.preload_adapter(url)
    assert not first.already_cached
    assert first.download_bytes == _shipped("swap-colors").stat().st_size and first.download_ms > 0
    assert (await client.preload_adapter(url)).already_cached
    await client.evict(url)
    revalidated = await client.preload_adapter(url)
    assert not revalidated.already_cached and revalidated.download_bytes == 0
    statuses = [entry.status for entry in web.logged() if entry.path == "/files/swap-colors-2.safetensors"]
    assert statuses == [200, 304]


async def test_a_pinned_sha256_is_checked_then_served_from_disk_with_no_request(client, web, cache_dir):
    digest = _sha256(_shipped("outline"))
    pinned = web.url("/files/outline-3.safetensors") + f"#sha256={digest}"
    local = await client.generate_image(PROMPT, adapter="outline", seed=2, num_inference_steps=STEPS)
    assert (await client.generate_image(PROMPT, adapter=pinned, seed=2, num_inference_steps=STEPS)).data == local.data
    await client.evict(pinned)
    served = web.requests("/files/outline-3.safetensors")
    assert (await client.generate_image(PROMPT, adapter=pinned, seed=2, num_inference_steps=STEPS)).data == local.data
    assert web.requests("/files/outline-3.safetensors") == served

    wrong = web.url("/files/purple-3.safetensors") + "#sha256=" + "0" * 64
    files_before = _disk(cache_dir)[0]
    with pytest.raises(LoraswapError) as refused:
        await client.generate_image(PROMPT, adapter=wrong, seed=2, num_inference_steps=STEPS)
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "URL_CHECKSUM_MISMATCH")
    assert _sha256(_shipped("purple")) in refused.value.message
    assert _disk(cache_dir) == (files_before, [])


def _refusals(web, untrusted_web) -> list[tuple[str, str, grpc.StatusCode, str]]:
    """(case, URL, code, reason): refused before anything is sent, or by what the URL's server answered."""
    files = web.url("/files/outline-4.safetensors")
    return [
        ("host not allowed", "https://example.com/a.safetensors" + SIGNED, grpc.StatusCode.PERMISSION_DENIED,
         "URL_HOST_NOT_ALLOWED"),
        ("scheme", "ftp://127.0.0.1/a.safetensors", grpc.StatusCode.INVALID_ARGUMENT, "URL_SCHEME_UNSUPPORTED"),
        ("credentials", files.replace("https://", "https://user:pw@"), grpc.StatusCode.INVALID_ARGUMENT,
         "URL_CREDENTIALS_IN_NAME"),
        ("plain http to a host not allowed insecurely",
         web.url("/files/outline-4.safetensors", https=False).replace("127.0.0.1", "localhost"),
         grpc.StatusCode.PERMISSION_DENIED, "URL_INSECURE_NOT_ALLOWED"),
        ("a name for loopback", files.replace("127.0.0.1", "localhost"), grpc.StatusCode.PERMISSION_DENIED,
         "URL_ADDRESS_NOT_ALLOWED"),
        ("redirect to a host not allowed", web.redirect_to("https://example.org/a.safetensors"),
         grpc.StatusCode.PERMISSION_DENIED, "URL_REDIRECT_REFUSED"),
        ("redirect to plain http", web.redirect_to(web.url("/files/outline-4.safetensors", https=False)),
         grpc.StatusCode.PERMISSION_DENIED, "URL_REDIRECT_REFUSED"),
        ("redirect to loopback", web.redirect_to(files.replace("127.0.0.1", "localhost")),
         grpc.StatusCode.PERMISSION_DENIED, "URL_ADDRESS_NOT_ALLOWED"),
        ("redirect loop", web.url("/loop"), grpc.StatusCode.FAILED_PRECONDITION, "URL_TOO_MANY_REDIRECTS"),
        ("dns", "https://no-such-host.invalid/a.safetensors", None, "URL_DNS_FAILED"),
        ("connection refused", closed_port_url() + "/a.safetensors", grpc.StatusCode.UNAVAILABLE,
         "URL_CONNECT_FAILED"),
        ("untrusted certificate", untrusted_web.url("/files/outline-4.safetensors"),
         grpc.StatusCode.FAILED_PRECONDITION, "URL_TLS_FAILED"),
        ("401", web.url("/private/outline-4.safetensors") + SIGNED, grpc.StatusCode.FAILED_PRECONDITION,
         "URL_ACCESS_DENIED"),
        ("404", web.url("/files/missing.safetensors") + SIGNED, grpc.StatusCode.NOT_FOUND, "URL_NOT_FOUND"),
        ("410", web.url("/status/410"), grpc.StatusCode.NOT_FOUND, "URL_GONE"),
        ("429", web.url("/status/429"), grpc.StatusCode.UNAVAILABLE, "URL_RATE_LIMITED"),
        ("500", web.url("/status/500"), grpc.StatusCode.UNAVAILABLE, "URL_SERVER_ERROR"),
        ("503", web.url("/status/503"), grpc.StatusCode.UNAVAILABLE, "URL_SERVER_ERROR"),
        ("content encoding", web.url("/gzip/outline-4.safetensors"), grpc.StatusCode.FAILED_PRECONDITION,
         "URL_CONTENT_ENCODING_REFUSED"),
        ("not safetensors", web.url("/files/page.html"), grpc.StatusCode.FAILED_PRECONDITION, "URL_NOT_SAFETENSORS"),
        ("too large", web.url("/files/large.safetensors"), grpc.StatusCode.RESOURCE_EXHAUSTED, "ADAPTER_TOO_LARGE"),
        ("no adapter for this model", web.url("/files/foreign.safetensors"), grpc.StatusCode.INVALID_ARGUMENT,
         None),
    ]  # fmt: skip


REFUSAL_CASES = [
    "host not allowed", "scheme", "credentials", "plain http to a host not allowed insecurely", "a name for loopback",
    "redirect to a host not allowed", "redirect to plain http", "redirect to loopback", "redirect loop", "dns",
    "connection refused", "untrusted certificate", "401", "404", "410", "429", "500", "503", "content encoding",
    "not safetensors", "too large", "no adapter for this model",
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSAL_CASES)
async def test_a_refused_url_leaves_nothing_cached_and_the_model_as_it_was(client, web, untrusted_web, cache_dir, case):
    _, url, code, reason = next(item for item in _refusals(web, untrusted_web) if item[0] == case)
    before = await client.generate_image(PROMPT, adapter="purple", seed=9, num_inference_steps=STEPS)
    listed, disk = await _listed(client), _disk(cache_dir)
    with pytest.raises(LoraswapError) as refused:
        await client.generate_image(PROMPT, adapter=url, seed=9, num_inference_steps=STEPS)
    error = refused.value
    if code is not None:
        assert error.code == code, error.message
    if reason is not None:
        assert error.reason == reason, error.message
    assert SECRET not in error.message and SECRET not in str(error.metadata)
    if case in ("429", "503"):
        assert error.retry_delay_s == 7.0  # nginx's Retry-After
    if case == "500":
        assert error.retry_delay_s is None  # no Retry-After: no RetryInfo
    assert await _listed(client) == listed
    assert _disk(cache_dir) == disk
    after = await client.generate_image(PROMPT, adapter="purple", seed=9, num_inference_steps=STEPS)
    assert after.data == before.data
    assert (await client.server_info()).recompilations == 0


HOSTILE = [
    ("trickle", {"size": 1_000, "interval": 0.3}, grpc.StatusCode.UNAVAILABLE, "URL_TIMED_OUT"),  # the deadline
    ("silent", {}, grpc.StatusCode.UNAVAILABLE, "URL_TIMED_OUT"),  # the read timeout
    ("endless", {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "ADAPTER_TOO_LARGE"),
    ("lying_length", {"claimed": 100_000, "sent": 1_000}, grpc.StatusCode.UNAVAILABLE, "URL_BODY_SHORT"),
    ("redirect_loop", {}, grpc.StatusCode.FAILED_PRECONDITION, "URL_TOO_MANY_REDIRECTS"),
    ("redirect_to", {"location": "https://example.org/a.safetensors"}, grpc.StatusCode.PERMISSION_DENIED,
     "URL_REDIRECT_REFUSED"),
    ("status", {"status": 503, "headers": {"Retry-After": "Wed, 21 Oct 2099 07:28:00 GMT"}},
     grpc.StatusCode.UNAVAILABLE, "URL_SERVER_ERROR"),
]  # fmt: skip


@pytest.mark.parametrize(("behaviour", "options", "code", "reason"), HOSTILE, ids=[case[0] for case in HOSTILE])
async def test_a_hostile_server_is_refused_while_others_are_served(client, cache_dir, behaviour, options, code, reason):
    before = await client.generate_image(PROMPT, adapter="swap-colors", seed=4, num_inference_steps=STEPS)
    listed, disk = await _listed(client), _disk(cache_dir)
    with HostileHttpServer(behaviour, **options) as hostile:
        url = hostile.url + "/a.safetensors" + SIGNED
        started = time.monotonic()
        fetch = asyncio.ensure_future(client.generate_image(PROMPT, adapter=url, seed=4, num_inference_steps=STEPS))
        served = await client.generate_image(PROMPT, adapter="swap-colors", seed=4, num_inference_steps=STEPS)
        served_after_s = time.monotonic() - started
        with pytest.raises(LoraswapError) as refused:
            await fetch
        failed_after_s = time.monotonic() - started
    assert (refused.value.code, refused.value.reason) == (code, reason), refused.value.message
    assert SECRET not in refused.value.message
    assert served.data == before.data
    if behaviour in ("trickle", "silent"):
        assert served_after_s < failed_after_s  # the others were served while it stalled
        assert failed_after_s < DEADLINE_S + 5.0
    if behaviour == "status":
        assert refused.value.retry_delay_s == 3600.0  # a date far ahead is capped at an hour
    assert await _listed(client) == listed
    assert _disk(cache_dir) == disk


async def test_slow_downloads_hold_up_no_local_load(client):
    """More slow hosts than URL loader threads: a local adapter not in the cache still loads at once."""
    with HostileHttpServer("trickle", size=1_000, interval=0.3) as slow:
        stalled = [
            asyncio.ensure_future(
                client.generate_image(PROMPT, adapter=f"{slow.url}/slow-{index}.safetensors", num_inference_steps=1)
            )
            for index in range(6)
        ]
        await asyncio.sleep(0.5)  # every download under way (or queued for a thread)
        if "outline" in await _listed(client):
            await client.evict("outline")
        started = time.monotonic()
        cold = await client.generate_image(PROMPT, adapter="outline", num_inference_steps=1)
        assert cold.timings.adapter_load_ms > 0 and time.monotonic() - started < DEADLINE_S / 2
        assert not any(task.done() for task in stalled)
        results = await asyncio.gather(*stalled, return_exceptions=True)
    assert {getattr(result, "reason", None) for result in results} == {"URL_TIMED_OUT"}


async def test_a_caller_that_gives_up_on_a_queued_download_breaks_it_for_no_one(client, web):
    """Every URL loader thread busy with a slow host; a request for another URL waits for a thread, and its caller
    gives up (a short deadline). The load they shared is not cancelled for the next caller."""
    url = web.url("/files/swap-colors-3.safetensors")
    with HostileHttpServer("trickle", size=1_000, interval=0.3) as slow:
        stalled = [
            asyncio.ensure_future(
                client.generate_image(PROMPT, adapter=f"{slow.url}/busy-{index}.safetensors", num_inference_steps=1)
            )
            for index in range(4)
        ]
        await asyncio.sleep(0.5)
        with pytest.raises(LoraswapError) as gave_up:
            await client.generate_image(PROMPT, adapter=url, num_inference_steps=1, timeout=0.5)
        assert gave_up.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.gather(*stalled, return_exceptions=True)
    image = await client.generate_image(PROMPT, adapter=url, seed=6, num_inference_steps=STEPS)
    local = await client.generate_image(PROMPT, adapter="swap-colors", seed=6, num_inference_steps=STEPS)
    assert image.data == local.data


async def test_no_cookie_a_host_sets_is_sent_anywhere(client):
    with HostileHttpServer("status", status=404) as second:
        headers = {"Set-Cookie": f"session={SECRET}; Path=/", "Location": second.url + "/next.safetensors"}
        with HostileHttpServer("status", status=302, headers=headers) as first:
            with pytest.raises(LoraswapError) as refused:
                await client.preload_adapter(first.url + "/a.safetensors")
            assert refused.value.reason == "URL_NOT_FOUND"
            with pytest.raises(LoraswapError):
                await client.preload_adapter(first.url + "/again.safetensors")
        received = first.received + second.received
    assert len(received) == 4
    assert not [request for request in received if "cookie" in request.headers]


async def test_an_identity_without_its_query_is_not_fetched(client, web):
    identity = web.url("/files/outline.safetensors") + "?0123456789ab"  # a digest where a query was
    with pytest.raises(LoraswapError) as refused:
        await client.preload_adapter(identity)
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME")
    assert "send the full URL" in refused.value.message


class TlsTrickler:
    """An HTTPS server (a certificate of the test CA) that trickles its answer a byte every `interval` s: the
    status line and headers too when `headers_too`, else only the body of a 100 kB Content-Length."""

    def __init__(self, ca: TestCertificateAuthority, tmp_path: Path, *, headers_too: bool, interval: float = 0.3):
        certificate, key = ca.issue_server().write(tmp_path, "trickler")
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(certificate, key)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        self._headers_too, self._interval = headers_too, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> TlsTrickler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(10)

    def _serve(self) -> None:
        try:
            raw, _ = self._listener.accept()
        except OSError:
            return
        with contextlib.suppress(OSError), self._context.wrap_socket(raw, server_side=True) as connection:
            while b"\r\n\r\n" not in connection.recv(65536):
                pass
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
            if not self._headers_too:
                connection.sendall(head)
            for byte in head if self._headers_too else b"x" * 100_000:
                if self._stop.wait(self._interval):
                    return
                connection.sendall(bytes([byte]))


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
async def test_an_https_host_trickling_is_cut_at_the_deadline(client, ca, cache_dir, tmp_path, headers_too):
    disk = _disk(cache_dir)
    with TlsTrickler(ca, tmp_path, headers_too=headers_too) as slow:
        started = time.monotonic()
        with pytest.raises(LoraswapError) as refused:  # a Generate: its first event came, so no client retries it
            await client.generate_image(PROMPT, adapter=slow.url + "/slow.safetensors", num_inference_steps=1)
        took = time.monotonic() - started
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.UNAVAILABLE, "URL_TIMED_OUT")
    assert DEADLINE_S - 0.5 < took < DEADLINE_S + 3.0, took
    assert _disk(cache_dir) == disk


async def test_a_slow_download_reports_its_bytes_in_queued_events(client, cache_dir):
    disk = _disk(cache_dir)
    with HostileHttpServer("trickle", size=10, interval=0.25) as slow:
        events = []
        with pytest.raises(LoraswapError) as refused:
            async for event in client.generate(PROMPT, adapter=slow.url + "/slow.safetensors", num_inference_steps=2):
                events.append(event)
    assert refused.value.reason == "URL_NOT_SAFETENSORS"  # ten bytes of filler, after all
    progress = [event for event in events if isinstance(event, Queued) and event.download_total_bytes]
    assert progress and all(event.loading_adapter and event.download_total_bytes == 10 for event in progress)
    done = [event.downloaded_bytes for event in progress]
    assert done == sorted(done) and len(set(done)) == len(done) and done[-1] <= 10
    assert _disk(cache_dir) == disk


async def test_metrics_count_downloads_bytes_and_failures_by_allowed_host(server, client, web):
    before = await scrape(server.metrics_port)
    url = web.url("/files/purple-4.safetensors")
    await client.preload_adapter(url)
    with pytest.raises(LoraswapError):
        await client.preload_adapter(web.url("/files/missing-2.safetensors"))
    after = await scrape(server.metrics_port)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("loraswap_url_downloads_total", host="127.0.0.1", outcome="downloaded") == 1
    assert delta("loraswap_url_download_bytes_total", host="127.0.0.1") == _shipped("purple").stat().st_size
    assert delta("loraswap_url_download_failures_total", host="127.0.0.1", reason="URL_NOT_FOUND") == 1
    assert ("loraswap_url_downloads_total", (("host", "*.invalid"), ("outcome", "downloaded"))) in after


async def test_the_disk_cache_keeps_downloads_across_a_restart_and_sends_tokens_to_their_host_only(web, tmp_path):
    """A server allowed private addresses, with a token for localhost: named hosts reached at the address
    checked (SNI and certificate by name), a token only where it belongs, and its downloads kept on disk."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"localhost {web.token}\n")
    cache = tmp_path / "cache"
    options = _url_settings(web, cache, allow_url_private_addresses=True, url_token_file=tokens)
    private = web.url("/private/outline-5.safetensors").replace("127.0.0.1", "localhost")
    pinned = web.url("/files/purple-5.safetensors") + f"#sha256={_sha256(_shipped('purple'))}"
    async with serving("shapes", None, **options) as running, client_of(running) as client:
        local = await client.generate_image(PROMPT, adapter="outline", seed=1, num_inference_steps=STEPS)
        assert (await client.generate_image(PROMPT, adapter=private, seed=1, num_inference_steps=STEPS)).data == (
            local.data
        )
        await client.preload_adapter(pinned)
        # The token is localhost's: a redirect to another host (127.0.0.1, the same nginx) does not carry it.
        redirect = web.redirect_to(web.url("/private/outline-5.safetensors")).replace("127.0.0.1", "localhost", 1)
        with pytest.raises(LoraswapError) as refused:
            await client.preload_adapter(redirect)
        assert refused.value.reason == "URL_ACCESS_DENIED"
        # SIGHUP re-reads the token file: a wrong token is now sent, and refused.
        tokens.write_text("localhost wrong-token\n")
        running.reload_credentials()
        await client.evict(private)
        with pytest.raises(LoraswapError) as refused:
            await client.preload_adapter(private)
        assert refused.value.reason == "URL_ACCESS_DENIED" and "token" in refused.value.message
        assert "wrong-token" not in refused.value.message
        tokens.write_text(f"localhost {web.token}\n")
        running.reload_credentials()
    logged_before = len(web.logged())
    # Started again with the same disk cache, preloading both: one revalidation (304, no body), no request at all
    # for the pinned one.
    async with serving("shapes", None, preload=(private, pinned), **options) as running, client_of(running) as client:
        listed = {adapter.id: adapter for adapter in (await client.list_adapters()).adapters}
        assert set(listed) == {private, pinned}
        assert (await client.generate_image(PROMPT, adapter=private, seed=1, num_inference_steps=STEPS)).data == (
            local.data
        )
    after = web.logged()[logged_before:]
    assert [(entry.path, entry.status) for entry in after] == [("/private/outline-5.safetensors", 304)]


async def test_a_disk_cache_budget_makes_room_and_refuses_what_cannot_fit(web, tmp_path):
    size = _shipped("outline").stat().st_size
    cache = tmp_path / "cache"
    options = _url_settings(web, cache, adapter_cache_dir_bytes=2 * size + size // 2)
    async with serving("shapes", None, **options) as running, client_of(running) as client:
        for name in ("outline-6", "purple-6", "swap-colors-6"):
            await client.preload_adapter(web.url(f"/files/{name}.safetensors"))
            await asyncio.sleep(0.02)  # distinct use times
        kept = _disk(cache)[0]
        assert len(kept) == 2 and _sha256(_shipped("outline")) not in kept  # the least recently used went
    options = _url_settings(web, tmp_path / "small", adapter_cache_dir_bytes=size // 2)
    async with serving("shapes", None, **options) as running, client_of(running) as client:
        with pytest.raises(LoraswapError) as full:
            await client.preload_adapter(web.url("/files/outline-6.safetensors"))
        assert (full.value.code, full.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "DISK_CACHE_FULL")
        assert _disk(tmp_path / "small") == (set(), [])
        assert await client.generate_image(PROMPT, adapter="outline", num_inference_steps=STEPS)
