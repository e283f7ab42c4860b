"""Web servers for the tests of fetching adapter files over HTTP(S): a real nginx, and small hostile servers.

`NginxFileServer` is a real web server (Debian's nginx, run as a child process with its own config, logs and
temp paths in a folder of its own, on ports the OS picked) that serves a folder over HTTPS and plain HTTP: the
answers a real file host gives (ETags and 304s, ranges, bearer tokens, redirects, error statuses with
Retry-After), so that a client is tested against what it will meet, not against our idea of it.

`HostileHttpServer` is what no honest server does (trickling, endless, lying about its length, redirecting in
circles, never answering), written in Python because nginx will not misbehave on request. `closed_port_url()`
is an address that refuses connections.

Nothing here is global: each server is a context manager that owns its process or threads and stops them on the
way out however the block ends.
"""

from __future__ import annotations

import contextlib
import http
import itertools
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pytest

from tests.support.certificates import SERVER_NAMES, TestCertificateAuthority

NGINX_FALLBACK = "/usr/sbin/nginx"
# How long a server may take to accept connections: nginx starts in tens of milliseconds, but on a crowded
# two-core CI machine a start can wait for a core.
START_TIMEOUT_S = 10.0
# How long nginx may take to stop on SIGTERM (its fast shutdown closes open connections at once).
STOP_TIMEOUT_S = 5.0
# The statuses /status/<code> answers, and those of them that say when to retry (Retry-After: RETRY_AFTER_S).
STATUSES = (404, 410, 429, 500, 502, 503)
RETRY_AFTER_STATUSES = (429, 503)
RETRY_AFTER_S = 7
# What RFC 6750 allows in a bearer token; anything else could not be written into nginx's config as it is.
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
# The path of the marker request `requests()` sends (and leaves out of what it counts); see `_sync_log`.
_SYNC_PREFIX = "/__logged/"


def require_nginx() -> str:
    """The nginx binary. Where there is none the calling module is skipped, but not on CI: there a missing nginx
    is a broken image, and skipping would pass the tests that need it without running them."""
    found = shutil.which("nginx") or (NGINX_FALLBACK if os.access(NGINX_FALLBACK, os.X_OK) else None)
    if found is None:
        if os.environ.get("CI"):
            raise RuntimeError("nginx is missing in CI: .ci/run must install it (apt-get install nginx)")
        pytest.skip("nginx is not installed here (.ci/run installs it: apt-get install nginx)", allow_module_level=True)
    return found


def _free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1. Another process may take it before ours binds it: a race
    the callers accept (NginxFileServer retries its start once when it loses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def closed_port_url() -> str:
    """`http://127.0.0.1:PORT` for a port nothing listens on: a connection to it is refused at once."""
    return f"http://127.0.0.1:{_free_port()}"


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class LoggedRequest:
    """One request as nginx logged it, once it had answered it."""

    method: str
    path: str  # the URI's path, percent-decoded and normalised by nginx ($uri), without the query
    query: str  # the raw query string ($args), "" when none
    status: int
    range: str  # the Range header the client sent, "" when none
    body_bytes: int  # the body bytes nginx sent ($body_bytes_sent; fewer than the file's when the client left)


# Tab-separated: nginx writes a tab inside a value as \x09 (as every control character, `"` and `\`), so the
# fields split cleanly whatever the client sent.
_LOG_FORMAT = "$request_method\\t$status\\t$body_bytes_sent\\t$http_range\\t$args\\t$uri"


def _parse_log_line(line: str) -> LoggedRequest:
    method, status, sent, ranges, query, path = line.split("\t", 5)
    return LoggedRequest(
        method=method,
        path=path,
        query="" if query == "-" else query,
        status=int(status),
        range="" if ranges == "-" else ranges,
        body_bytes=int(sent),
    )


class NginxFileServer:
    """nginx serving `root` over HTTPS (a certificate `ca` issued for localhost and 127.0.0.1) and plain HTTP.

        with NginxFileServer(root, ca, token="s3cret") as web:
            httpx.get(f"{web.https_url}/files/a.safetensors", verify=str(web.ca_file))

    Both listeners serve the same locations:

    - `/files/<path>`: the files under `root`, as nginx serves static files: ETag and Last-Modified (so
      `If-None-Match` or `If-Modified-Since` give 304), byte ranges (206, 416), 404 for what is not there.
    - `/private/<path>`: the same files, only with `Authorization: Bearer <token>`; 401 without the header (with
      `WWW-Authenticate: Bearer`), 403 with any other value.
    - `/redirect/<path>`: 302 to `/files/<path>` (and the same query), a relative Location (`/files/...`; the
      client resolves it against the URL it asked, so it stays on the same scheme and port).
    - `/redirect-to?u=<url>`: 302 with `Location: <url>` exactly as it stands in the query: nginx does not
      percent-decode it, so `u` must be written unencoded (use `redirect_to(url)`), which works for any URL
      without `&`, `#`, spaces or non-ASCII characters (an http(s) URL with a path and a query without `&`).
      A `u` that is missing, or that starts `http%3A`/`https%3A` (percent-encoded, as httpx's `params=` writes
      it), gets 400 rather than a broken Location.
    - `/loop`: 302 to `/loop`, for ever.
    - `/status/<code>` (and `/status/<code>/<anything>`) for each code in STATUSES: that status, with nginx's
      own error page; 429 and 503 with `Retry-After: 7`.
    - `/gzip/<path>`: the file as it is, under a `Content-Encoding: gzip` header whatever the client asked for
      (the body is not gzip): a server that encodes when told not to.

    `requests(prefix)` and `logged()` read nginx's access log; the config and logs lie in `workdir` (a
    temporary folder removed on exit unless the caller passed its own, which is kept).
    """

    def __init__(
        self,
        root: Path,
        ca: TestCertificateAuthority | None = None,
        token: str | None = None,
        *,
        workdir: Path | None = None,
        start_timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"{self.root} is not a folder to serve")
        self.ca = ca if ca is not None else TestCertificateAuthority()
        self.token = token if token is not None else secrets.token_urlsafe(16)
        if not _BEARER_TOKEN.fullmatch(self.token):
            raise ValueError(f"not a bearer token nginx's config can hold as it is: {self.token!r}")
        self._nginx = require_nginx()
        self._own_workdir = workdir is None
        self._workdir_arg = workdir
        self._start_timeout = start_timeout
        self._process: subprocess.Popen | None = None
        self._markers = itertools.count(1)  # next() on it is atomic: requests() may be called from threads
        self.workdir = Path()
        self.ca_file = Path()
        self.error_log = Path()
        self.access_log = Path()
        self._pid_file = Path()
        self._certificate = self._key = Path()
        self.https_port = self.http_port = 0
        self.https_url = self.http_url = ""

    def __enter__(self) -> NginxFileServer:
        self.workdir = Path(tempfile.mkdtemp(prefix="nginx-")) if self._workdir_arg is None else self._workdir_arg
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._prepare()
            try:
                self._start()
            except _PortTaken:
                self._start()  # another process took a port between _free_port and nginx's bind: new ports, once
        except BaseException:
            self._stop()
            self._remove_workdir()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            self._stop()
        finally:
            self._remove_workdir()

    def url(self, path: str, *, https: bool = True) -> str:
        """The URL of `path` (starting with /) on the HTTPS listener, or the plain HTTP one."""
        return (self.https_url if https else self.http_url) + path

    def redirect_to(self, target: str, *, https: bool = True) -> str:
        """The URL of `/redirect-to` that answers 302 to `target`, which nginx passes on as written: so no `&`
        (it would end the argument), `#`, whitespace or non-ASCII in it."""
        if re.search(r"[&#\s]|[^\x21-\x7e]", target):
            raise ValueError(f"/redirect-to cannot pass on {target!r}: no '&', '#', spaces or non-ASCII")
        return self.url(f"/redirect-to?u={target}", https=https)

    def logged(self) -> list[LoggedRequest]:
        """Every request nginx has answered so far, in the order it finished them (see `requests`)."""
        self._sync_log()
        return [entry for entry in self._read_log() if not entry.path.startswith(_SYNC_PREFIX)]

    def requests(self, prefix: str) -> int:
        """How many requests nginx has answered whose path (percent-decoded, without the query) starts with
        `prefix`, over both listeners; counted once each answer is complete on nginx's side.

        nginx writes an access log line right after the last byte of its answer leaves, in the same step, so a
        client can read the answer a moment before the line is there; this first sends a marker request of
        its own and waits for its line: nginx's one worker handles its connections in turn, so every answer
        that had finished before the marker arrived is in the log by then."""
        return sum(entry.path.startswith(prefix) for entry in self.logged())

    # -- start and stop

    def _prepare(self) -> None:
        for folder in ("logs", "temp"):
            (self.workdir / folder).mkdir(exist_ok=True)
        # The served folder is reached through a link, so that no path of the caller's is written into the
        # config (where a space, quote or `$` would need escaping).
        served = self.workdir / "served"
        if served.is_symlink():
            served.unlink()
        served.symlink_to(self.root, target_is_directory=True)
        self.ca_file = self.workdir / "ca.pem"
        self.ca_file.write_bytes(self.ca.certificate_pem)
        self._certificate, self._key = self.ca.issue_server(SERVER_NAMES).write(self.workdir, "server")
        self.error_log = self.workdir / "logs" / "error.log"
        self.access_log = self.workdir / "logs" / "access.log"
        self._pid_file = self.workdir / "nginx.pid"

    def _start(self) -> None:
        self.https_port, self.http_port = _free_port(), _free_port()
        while self.http_port == self.https_port:
            self.http_port = _free_port()
        self.https_url = f"https://127.0.0.1:{self.https_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        config = self.workdir / "nginx.conf"
        config.write_text(self._config())
        self.error_log.write_bytes(b"")
        self.access_log.write_bytes(b"")
        self._pid_file.unlink(missing_ok=True)
        output = (self.workdir / "logs" / "nginx.out").open("wb")
        with output:
            # Its own session, so that a kill on the way out can reach the worker with the master (SIGKILL to the
            # master alone would leave the worker serving).
            self._process = subprocess.Popen(
                [self._nginx, "-p", f"{self.workdir}/", "-c", str(config), "-e", str(self.error_log)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                start_new_session=True,
            )
        deadline = time.monotonic() + self._start_timeout
        while not self._started():
            if self._process.poll() is not None:
                status = self._process.returncode
                self._process = None
                raise RuntimeError(f"nginx exited with status {status} on start: {self._error_tail()}")
            if "Address already in use" in self._error_tail():
                self._stop()  # rather than wait through nginx's own retries, half a second apart
                raise _PortTaken(self._error_tail())
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nginx did not accept connections within {self._start_timeout} s: {self._error_tail()}"
                )
            time.sleep(0.01)

    def _started(self) -> bool:
        """Whether nginx has bound both ports and accepts connections. A port that accepts is not enough on its
        own: another process may hold it (the race in _free_port). nginx writes its pid file only once it has
        bound every listener, so that file, with nginx's pid in it, says the ports are nginx's."""
        assert self._process is not None
        try:
            written = int(self._pid_file.read_text().strip() or 0)
        except (OSError, ValueError):
            return False
        return (
            written == self._process.pid
            and _accepts_connections(self.https_port)
            and _accepts_connections(self.http_port)
        )

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: nginx's fast shutdown, which does not wait for open connections
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT_S)

    def _remove_workdir(self) -> None:
        if self._own_workdir and self.workdir != Path():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _error_tail(self) -> str:
        texts = []
        for path in (self.error_log, self.workdir / "logs" / "nginx.out"):
            with contextlib.suppress(OSError):
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)[-3000:] or "(nothing logged)"

    # -- the access log

    def _read_log(self) -> list[LoggedRequest]:
        return [_parse_log_line(line) for line in self.access_log.read_text(errors="replace").splitlines() if line]

    def _sync_log(self, timeout: float = START_TIMEOUT_S) -> None:
        """Send a request of our own and wait until nginx has logged it (see `requests`)."""
        marker = f"{_SYNC_PREFIX}{next(self._markers)}"
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=timeout) as connection:
            connection.sendall(f"GET {marker} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            while connection.recv(65536):
                pass
        deadline = time.monotonic() + timeout
        while not any(entry.path == marker for entry in self._read_log()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not log {marker} within {timeout} s: {self._error_tail()}")
            time.sleep(0.005)

    # -- the config

    def _config(self) -> str:
        temp = self.workdir / "temp"
        # Run as root (as the tests do), nginx's worker would switch to `nobody`, which cannot read the tests'
        # folders (pytest's tmp_path is 0700): it stays root. Run as anyone else, it cannot switch anyway.
        user = "user root;" if os.geteuid() == 0 else ""
        served = self.workdir / "served"
        statuses = "\n".join(
            f"        location ~ ^/status/{code}(/|$) {{\n"
            + (f"            add_header Retry-After {RETRY_AFTER_S} always;\n" if code in RETRY_AFTER_STATUSES else "")
            + f"            return {code};\n        }}"
            for code in STATUSES
        )
        return f"""# tests/support/web_servers.py wrote this for one test server: all it writes is under {self.workdir}.
{user}
daemon off;
master_process on;
worker_processes 1;
pid {self._pid_file};
lock_file {self.workdir}/nginx.lock;
error_log {self.error_log} warn;

events {{
    worker_connections 512;
}}

http {{
    default_type application/octet-stream;
    sendfile on;
    keepalive_timeout 30s;
    server_tokens off;
    gzip off;
    # Locations given as /files/..., not http://127.0.0.1:PORT/files/...: resolved by the client against the URL
    # it asked, whichever listener that was.
    absolute_redirect off;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    log_format counted "{_LOG_FORMAT}";
    access_log {self.access_log} counted;

    # /redirect/<rest> -> /files/<rest>, taken from the request line as the client wrote it (still
    # percent-encoded, query and all), so that the Location is a valid URL whatever the path holds.
    map $request_uri $redirect_target {{
        "~^/redirect/(?<rest>.*)$" /files/$rest;
        default /files/;
    }}

    server {{
        listen 127.0.0.1:{self.https_port} ssl http2;
        listen 127.0.0.1:{self.http_port};
        server_name localhost 127.0.0.1;
        ssl_certificate {self._certificate};
        ssl_certificate_key {self._key};

        location = / {{
            return 404;
        }}
        location /files/ {{
            alias {served}/;
        }}
        location /private/ {{
            add_header WWW-Authenticate 'Bearer realm="loraswap test"' always;
            if ($http_authorization = "") {{
                return 401;
            }}
            if ($http_authorization != "Bearer {self.token}") {{
                return 403;
            }}
            alias {served}/;
        }}
        location /gzip/ {{
            alias {served}/;
            add_header Content-Encoding gzip;
        }}
        location /redirect/ {{
            return 302 $redirect_target;
        }}
        location = /redirect-to {{
            if ($arg_u = "") {{
                return 400;
            }}
            if ($arg_u ~* "^https?%3A") {{
                return 400;
            }}
            return 302 $arg_u;
        }}
        location = /loop {{
            return 302 /loop;
        }}
{statuses}
        location {_SYNC_PREFIX} {{
            return 204;
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


class _PortTaken(RuntimeError):
    """nginx could not bind a port _free_port had found free: another process took it in between."""


# -- hostile servers


@dataclass(frozen=True)
class ReceivedRequest:
    """A request a HostileHttpServer read (its head only: request bodies are never read)."""

    method: str
    target: str  # as on the request line: /path?query
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value


_BEHAVIOURS = {
    "trickle": {"size": 1_000_000, "interval": 1.0},
    "endless": {},
    "lying_length": {"claimed": 100_000, "sent": 1000, "body": None},
    "redirect_loop": {},
    "redirect_to": {"location": None},
    "silent": {},
    "status": {"status": None, "headers": {}},
}
_ENDLESS_CHUNK = b"\0" * 65536
_HEAD_LIMIT = 65536


class HostileHttpServer:
    """A plain-HTTP server on 127.0.0.1 that misbehaves in one way, `behaviour`, on every connection:

    - "trickle": 200 with `Content-Length: size` (default 1_000_000), then one byte every `interval` seconds
      (default 1.0) until the client leaves (or, if it waits that long, all `size` bytes).
    - "endless": 200, `Transfer-Encoding: chunked`, 64 KiB chunks of zeros as fast as the client reads them,
      until the client leaves.
    - "lying_length": 200 with `Content-Length: claimed` (default 100_000), then `sent` bytes (default 1000;
      `body`, bytes, replaces them), then the connection closes.
    - "redirect_loop": 302 with its own URL (absolute) as the Location, on every request.
    - "redirect_to": 302 to `location` (required), on every request.
    - "silent": reads the request and never answers; the connection stays open until the client closes it or
      the server stops.
    - "status": `status` (required) with the `headers` (a dict) and a short text body.

    Each connection first reads the request's head (up to the blank line). The answers that end (redirects,
    status) keep the connection open for the next request, as a real server would, and are counted in
    `received`; `connections` counts the connections accepted. A thread accepts and one thread serves each
    connection; on exit every open connection is shut down and every thread joined.
    """

    def __init__(self, behaviour: str, **options: object) -> None:
        if behaviour not in _BEHAVIOURS:
            raise ValueError(f"no behaviour {behaviour!r}: one of {', '.join(_BEHAVIOURS)}")
        unknown = set(options) - set(_BEHAVIOURS[behaviour])
        if unknown:
            raise TypeError(f"{behaviour} takes no {', '.join(sorted(unknown))}")
        self.behaviour = behaviour
        self.options = {**_BEHAVIOURS[behaviour], **options}
        required = {"redirect_to": "location", "status": "status"}.get(behaviour)
        if required is not None and self.options[required] is None:
            raise TypeError(f"{behaviour} needs {required}=")
        self.connections = 0
        self.received: list[ReceivedRequest] = []
        self.url = ""
        self.port = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._open: set[socket.socket] = set()
        self._handlers: list[threading.Thread] = []

    def __enter__(self) -> HostileHttpServer:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.05)  # how often the accepting thread looks whether the server stops
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._acceptor = threading.Thread(target=self._accept, name=f"hostile-{self.behaviour}-accept", daemon=True)
        self._acceptor.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(START_TIMEOUT_S)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)  # wakes its thread in recv or send
            handlers = list(self._handlers)
        deadline = time.monotonic() + START_TIMEOUT_S
        for handler in handlers:
            handler.join(max(0.0, deadline - time.monotonic()))
        left = [handler.name for handler in handlers if handler.is_alive()]
        if left and kind is None:
            raise RuntimeError(f"connection threads did not end: {left}")

    # -- connections

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    connection.close()
                    return
                self.connections += 1
                self._open.add(connection)
                handler = threading.Thread(
                    target=self._serve,
                    args=(connection,),
                    name=f"hostile-{self.behaviour}-{self.connections}",
                    daemon=True,
                )
                self._handlers.append(handler)
            handler.start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            buffered = b""
            while not self._stopping.is_set():
                head, buffered = _read_head(connection, buffered)
                if head is None:
                    return
                with self._lock:
                    self.received.append(head)
                if not self._answer(connection, head):
                    return
        except OSError:
            return  # the client left, or the server stopped
        finally:
            with self._lock:
                self._open.discard(connection)
            connection.close()

    def _answer(self, connection: socket.socket, request: ReceivedRequest) -> bool:
        """Answer one request; whether the connection may carry another."""
        options = self.options
        behaviour = self.behaviour
        if behaviour == "trickle":
            size, interval = int(options["size"]), float(options["interval"])
            connection.sendall(_head(200, {"Content-Type": "application/octet-stream", "Content-Length": str(size)}))
            for _ in range(size):
                if self._stopping.wait(interval):
                    break
                connection.sendall(b"\0")
            return False
        if behaviour == "endless":
            connection.sendall(_head(200, {"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"}))
            chunk = f"{len(_ENDLESS_CHUNK):x}\r\n".encode() + _ENDLESS_CHUNK + b"\r\n"
            while not self._stopping.is_set():
                connection.sendall(chunk)
            return False
        if behaviour == "lying_length":
            body = options["body"] if options["body"] is not None else b"\0" * int(options["sent"])
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(int(options["claimed"]))}
            connection.sendall(_head(200, headers) + bytes(body))
            self._close_gently(connection)
            return False
        if behaviour == "silent":
            while not self._stopping.is_set():
                readable, _, _ = select.select([connection], [], [], 0.05)
                if readable and not connection.recv(65536):
                    break  # the client gave up
            return False
        if behaviour == "redirect_loop":
            return self._finite(connection, request, 302, {"Location": f"{self.url}{request.target}"})
        if behaviour == "redirect_to":
            return self._finite(connection, request, 302, {"Location": str(options["location"])})
        headers = dict(options["headers"])  # "status"
        return self._finite(connection, request, int(options["status"]), {str(k): str(v) for k, v in headers.items()})

    def _finite(
        self, connection: socket.socket, request: ReceivedRequest, status: int, headers: dict[str, str]
    ) -> bool:
        # No body where HTTP allows none (HEAD, 1xx, 204, 304): the client would read it as the next answer.
        bodiless = request.method == "HEAD" or status < 200 or status in (204, 304)
        body = b"" if bodiless else f"{status} from a hostile test server\n".encode()
        names = {name.lower() for name in headers}
        extra = {"Content-Type": "text/plain", "Content-Length": str(len(body))}
        if status < 200 or status == 204:
            del extra["Content-Length"]  # which HTTP forbids on these
        extra = {name: value for name, value in extra.items() if name.lower() not in names}
        connection.sendall(_head(status, {**headers, **extra}) + body)
        return request.headers.get("connection", "").lower() != "close"

    def _close_gently(self, connection: socket.socket) -> None:
        """End our side and wait (briefly) for the client to close its own: a close with its bytes unread would
        send a reset, and a reset may throw away what the client had not yet read of the answer."""
        connection.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 2.0
        while not self._stopping.is_set() and time.monotonic() < deadline:
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable and not connection.recv(65536):
                return


def _read_head(connection: socket.socket, buffered: bytes) -> tuple[ReceivedRequest | None, bytes]:
    """The next request's head from `connection` (after what was `buffered`) and the bytes read past it; None
    when the client closed first or sent no HTTP head."""
    while b"\r\n\r\n" not in buffered:
        if len(buffered) > _HEAD_LIMIT:
            return None, b""
        data = connection.recv(65536)
        if not data:
            return None, b""
        buffered += data
    head, rest = buffered.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None, b""
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return ReceivedRequest(method=parts[0], target=parts[1], headers=headers), rest


def _head(status: int, headers: dict[str, str]) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")
