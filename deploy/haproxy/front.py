"""Start N local loraswap replicas (each on a port the OS picks, loopback only) and HAProxy in front of them.

    python deploy/haproxy/front.py --replicas 3 [--front-port 50050] [-- extra `loraswap serve` flags]
    python deploy/haproxy/front.py --front-cert f.crt --front-key f.key \
        --replica-ca ca.pem -- --tls-cert r.crt --tls-key r.key     (TLS at the front and to the replicas)

It waits until every replica answers SERVING on the gRPC health service, renders
deploy/haproxy/haproxy.cfg for those replicas (only the `bind`, `stats socket` and
`server` lines, the per-replica least-busy rules and the hot share's 5N change; every
other knob is the file's), starts HAProxy, waits until HAProxy sees
every replica up, prints one JSON line with the front's address, and runs until
SIGINT/SIGTERM, then stops everything. The tests and benchmarks/scaleout.py use
`LocalFront` directly: it also kills a replica and starts it again in its slot, and
reads HAProxy's log line of each call (haproxy.log in its working folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CONFIG = Path(__file__).resolve().parent / "haproxy.cfg"
SERVER_LINE = re.compile(r"^(\s*)server replica\d+ .*$", re.MULTILINE)
BIND_LINE = re.compile(r"^(\s*)bind 127\.0\.0\.1:\d+ proto h2$", re.MULTILINE)
STATS_LINE = re.compile(r"^(\s*)stats socket \S+", re.MULTILINE)
BALANCE_LINE = re.compile(r"^(\s*)balance \S+$", re.MULTILINE)
FACTOR_LINE = re.compile(r"^(\s*)hash-balance-factor \d+$", re.MULTILINE)
# The hot-adapter rules: 5N in "more than 2/(5N) of all calls", the least-busy block written per replica, and the
# rule that sends a hot adapter's call to the least busy replica.
HOT_SHARE = re.compile(r"(sc_http_req_rate\(0\),mul\()\d+(\))")
LEAST_BUSY_BLOCK = re.compile(
    r"^(\s*)# BEGIN least busy replica.*?^\s*# END least busy replica$", re.MULTILINE | re.DOTALL
)
# The rule that sends a hot adapter's call to the least busy replica, and the capture that logs it.
USE_LEAST_BUSY = re.compile(r"^\s*(use-server %\[var|http-request capture var)\(txn\.least_busy\)\]?.*\n", re.MULTILINE)
# One call in HAProxy's log (`option httplog`, the captures {x-request-id|lora|hot}): accept date, frontend,
# backend/server, TR/Tw/Tc/Tr/Ta, status, bytes, cookies, termination state, ac/fc/bc/sc/rc, sq/bq, captures.
REQUEST_LOG_LINE = re.compile(
    r"^\S+ \[[^\]]+\] \S+ [^/\s]+/(?P<server>\S+) -?\d+/-?\d+/(?P<connect_ms>-?\d+)/-?\d+/\+?(?P<total_ms>-?\d+) "
    r"(?P<status>-?\d+) \+?\d+ \S+ \S+ (?P<termination>\S{4}) \d+/\d+/\d+/\d+/(?P<retries>\+?\d+) \d+/\d+ "
    r"\{(?P<request_id>[^|}]*)\|(?P<lora>[^|}]*)\|(?P<hot>[^}]*)\} "
)


def render_config(
    replica_ports: list[int],
    front_bind: str,
    stats_socket: Path,
    balance: str | None = None,
    balance_factor: int | None = None,
    front_pem: Path | None = None,
    replica_ca: Path | None = None,
    replica_name: str = "localhost",
    hot_adapters: bool = True,
) -> str:
    """deploy/haproxy/haproxy.cfg with its bind address (`127.0.0.1:PORT`, or `fd@N` for a socket the caller
    opened), stats socket and server lines for these replicas; `balance` replaces the balance algorithm
    (benchmarks compare `roundrobin`) and `balance_factor` the hash-balance-factor.

    `front_pem` (certificate chain, then private key, in one PEM file) terminates TLS at the front; `replica_ca`
    re-encrypts to replicas that serve TLS with certificates it signed for `replica_name`, health checks too.
    `hot_adapters=False` leaves out the rule that sends a hot adapter's calls to the least busy replica (the
    tests of the balance factor's bound alone)."""
    text = CONFIG.read_text()
    servers = [m for m in SERVER_LINE.finditer(text)]
    block = LEAST_BUSY_BLOCK.search(text)
    if not servers or not BIND_LINE.search(text) or block is None or not HOT_SHARE.search(text):
        raise ValueError(
            f"{CONFIG} lacks a line front.py renders: `bind 127.0.0.1:PORT proto h2`, `server replicaN`, "
            "the least-busy block or the hot share's `sc_http_req_rate(0),mul(5N)`"
        )
    names = [f"replica{i}" for i in range(1, len(replica_ports) + 1)]
    text = text[: block.start()] + least_busy_block(block.group(1), names) + text[block.end() :]
    text = HOT_SHARE.sub(lambda m: f"{m.group(1)}{5 * len(replica_ports)}{m.group(2)}", text)
    if not hot_adapters:
        text = USE_LEAST_BUSY.sub("", text)
    servers = [m for m in SERVER_LINE.finditer(text)]
    indent = servers[0].group(1)
    tls = ""
    if replica_ca is not None:
        tls = f" ssl verify required ca-file {replica_ca} verifyhost {replica_name} alpn h2 check-ssl check-alpn h2"
    lines = "\n".join(f"{indent}server replica{i} 127.0.0.1:{port}{tls}" for i, port in enumerate(replica_ports, 1))
    text = text[: servers[0].start()] + lines + text[servers[-1].end() :]
    listen = "proto h2" if front_pem is None else f"ssl crt {front_pem} alpn h2"
    text = BIND_LINE.sub(lambda m: f"{m.group(1)}bind {front_bind} {listen}", text)
    if balance is not None:
        text = BALANCE_LINE.sub(lambda m: f"{m.group(1)}balance {balance}", text)
    if balance_factor is not None:
        text = FACTOR_LINE.sub(lambda m: f"{m.group(1)}hash-balance-factor {balance_factor}", text)
    return STATS_LINE.sub(lambda m: f"{m.group(1)}stats socket {stats_socket}", text)


def least_busy_block(indent: str, names: list[str]) -> str:
    """Rules that leave in txn.least_busy the replica with the fewest calls, open on it or waiting for it in
    HAProxy's queue, among those up with a weight above 0 (what an operator sets to drain one: HAProxy 2.6 has no
    sample fetch for `state drain`), ties broken at random (a fixed order would send every tie to the first
    replica); computed only for a hot adapter's call (when txn.least_busy_score is set): a replica's score is
    (open + queued calls) x 1000 + rand(1000)."""
    lines = [f"{indent}# BEGIN least busy replica (deploy/haproxy/front.py writes these five lines for each replica)"]
    hot = "{ var(txn.least_busy_score) -m found }"
    for name in names:
        lines += [
            f"{indent}http-request set-var(txn.tie) rand(1000) if {hot}",
            f"{indent}http-request set-var(txn.queued) srv_queue({name}) if {hot}",
            f"{indent}http-request set-var(txn.score) srv_conn({name}),add(txn.queued),mul(1000),add(txn.tie) if {hot}",
            (
                f"{indent}http-request set-var(txn.least_busy) str({name}) if {hot} {{ srv_is_up({name}) }} "
                f"{{ srv_weight({name}) gt 0 }} {{ var(txn.score),sub(txn.least_busy_score) lt 0 }}"
            ),
            f"{indent}http-request set-var(txn.least_busy_score) var(txn.score) if {{ var(txn.least_busy) -m str {name} }}",
        ]
    lines.append(f"{indent}# END least busy replica")
    return "\n".join(lines)


@dataclass(frozen=True)
class FrontLogLine:
    """One call as HAProxy logged it when it ended."""

    request_id: str  # the caller's x-request-id ("" when it sent none)
    lora: str
    server: str  # the replica that took it in the end (after any retry), or <NOSRV>
    steered_to: str  # the replica the hot-adapter rule chose for it; "" when the ring chose
    connect_ms: int  # Tc: time to connect to that replica; -1 when no connection was made (the call never reached it)
    total_ms: int  # Ta: from the request to the end of the response
    status: int  # HTTP status: 200 for every answer from a gRPC server, 502/503 from HAProxy when none came
    termination: str  # e.g. "----" (normal), "SD--" (the replica's connection ended while it streamed the answer)
    retries: int
    redispatched: bool  # retried on another replica

    @property
    def reached_server(self) -> bool:
        """Whether the call got a connection to `server`, so that its request was sent there."""
        return self.connect_ms >= 0


def parse_request_log(text: str) -> list[FrontLogLine]:
    """The calls in HAProxy's log, in the order they ended (other lines, such as server state changes, skipped)."""
    lines = []
    for match in map(REQUEST_LOG_LINE.match, text.splitlines()):
        if match is None:
            continue
        retries = match["retries"]
        lines.append(
            FrontLogLine(
                request_id=match["request_id"],
                lora=match["lora"],
                server=match["server"],
                steered_to=match["hot"],
                connect_ms=int(match["connect_ms"]),
                total_ms=int(match["total_ms"]),
                status=int(match["status"]),
                termination=match["termination"],
                retries=int(retries.lstrip("+")),
                redispatched=retries.startswith("+"),
            )
        )
    return lines


@dataclass
class Replica:
    """One `loraswap serve` process on a port the OS picked."""

    process: subprocess.Popen
    log_path: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# `python -c _LAUNCHER PID COMMAND...` sets its parent-death signal (PR_SET_PDEATHSIG, 1: SIGTERM when the thread
# that started it ends, hence LocalFront._popen; Linux, kept across exec), exits if that parent (PID) is gone, and
# becomes COMMAND: no replica or HAProxy outlives a killed benchmark or test. Not a preexec_fn: with one,
# subprocess must fork() and run Python in the child, and a child forked while other threads were inside gRPC
# died there of SIGSEGV (gRPC logs "skipping fork() handlers"), as replicas restarted beside a running closed loop
# did (3 restarts of 9). Without one it uses vfork and execs at once.
_LAUNCHER = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _ending_with_parent(command: list[str]) -> list[str]:
    """`command`, run so that it gets SIGTERM when the thread that starts it ends (Linux)."""
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *command]


def start_replica(
    serve_flags: list[str],
    log_path: Path,
    env: dict[str, str],
    popen: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> Replica:
    """Start `loraswap serve --host 127.0.0.1 --port 0 ...` (with `popen`); the port is known once it prints it."""
    command = [sys.executable, "-m", "loraswap.client.command", "serve", "--host", "127.0.0.1", "--port", "0"]
    log = log_path.open("w")
    process = popen(
        _ending_with_parent([*command, *serve_flags]),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,
    )
    replica = Replica(process=process, log_path=log_path)
    line = process.stdout.readline()  # "loraswap: listening on port N, loading MODEL"
    match = re.search(r"listening on port (\d+)", line)
    if match is None:
        process.kill()
        status = f"exit status {process.wait()}"
        raise RuntimeError(f"replica did not start ({status}): {line!r}; log: {log_path.read_text()[-2000:]}")
    replica.port = int(match.group(1))
    # Keep draining stdout so the replica never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
    return replica


def replica_channel(address: str, ca_pem: bytes | None = None):
    """A blocking gRPC channel to one replica: plaintext, or TLS trusting the CA certificates in `ca_pem`."""
    import grpc

    if ca_pem is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem))


def wait_serving(address: str, timeout: float, ca_pem: bytes | None = None, replica: Replica | None = None) -> None:
    """Block until the gRPC health service at address answers SERVING (over TLS trusting `ca_pem` if given);
    raise at once, with the end of its log, if `replica`'s process exits first (its start-up failed)."""
    import grpc

    from loraswap.server.healthcheck import serving_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica is not None and replica.process.poll() is not None:
            log = replica.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"replica {address} exited ({replica.process.returncode}) before SERVING:\n{log}")
        with contextlib.suppress(grpc.RpcError):
            if serving_status(address, timeout=2, ca_pem=ca_pem) == "SERVING":
                return
        time.sleep(0.2)
    raise TimeoutError(f"{address} was not SERVING within {timeout:.0f} s")


@dataclass
class LocalFront:
    """N replicas and HAProxy in front of them, all on loopback; a context manager."""

    replicas: int = 3
    serve_flags: list[str] = field(default_factory=list)
    front_port: int = 0
    ready_timeout: float = 600.0
    env: dict[str, str] | None = None
    balance: str | None = None  # None: the file's (hdr(lora))
    balance_factor: int | None = None  # None: the file's
    hot_adapters: bool = True  # False: no least-busy rule for hot adapters (the bound alone decides)
    # TLS at the front: its certificate chain and private key (PEM files; HAProxy gets them joined in one).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # The replicas serve TLS (pass --tls-cert/--tls-key in serve_flags) with certificates this CA (PEM) signed
    # for `localhost`: HAProxy re-encrypts to them and checks their health over TLS.
    replica_ca: Path | None = None
    # Config, logs and stats socket. None: a new temporary folder, removed when the `with` block ends cleanly and
    # kept with its logs when it ends in an error, or always with keep_workdir (the command line prints where it
    # is). A folder the caller names is never removed (tests pass pytest's, which keeps the last runs' logs).
    workdir: Path | None = None
    keep_workdir: bool = False
    started: list[Replica] = field(default_factory=list, init=False)
    haproxy: subprocess.Popen | None = field(default=None, init=False)
    port: int = field(default=0, init=False)
    _env: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _restarts: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        # Every child is started from this one thread: a child's parent-death signal follows the thread that
        # started it (Linux), and this one lasts as long as the front, whichever thread starts or restarts a
        # replica (asyncio.to_thread's end when their event loop does).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-front")
        self._owns_workdir = self.workdir is None
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="loraswap-front-"))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stats_socket(self) -> Path:
        return self.workdir / "haproxy.sock"

    def __enter__(self) -> LocalFront:
        self.start()
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.stop(remove_workdir=exc_type is None and self._owns_workdir and not self.keep_workdir)

    def start(self) -> None:
        """Start the replicas, wait for each to serve, then HAProxy, and wait until it sees them all up."""
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            raise FileNotFoundError("haproxy is not installed (Debian: apt-get install haproxy)")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("HF_HUB_OFFLINE", "1")
        self._env = env
        try:
            for index in range(self.replicas):
                log_path = self.workdir / f"replica{index + 1}.log"
                self.started.append(start_replica(self.serve_flags, log_path, env, self._popen))
            for replica in self.started:
                wait_serving(replica.address, self.ready_timeout, self._replica_ca_pem(), replica)
            front_pem = self._front_pem()
            # Port 0: this process binds a socket the OS gives a port to and hands HAProxy its descriptor.
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.front_port))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            bind = f"fd@{listener.fileno()}"
            config = self.workdir / "haproxy.cfg"
            config.write_text(
                render_config(
                    [r.port for r in self.started],
                    bind,
                    self.stats_socket,
                    self.balance,
                    self.balance_factor,
                    front_pem=front_pem,
                    replica_ca=self.replica_ca,
                    hot_adapters=self.hot_adapters,
                )
            )
            with listener:
                check = subprocess.run(
                    [haproxy, "-c", "-f", str(config)],
                    capture_output=True,
                    text=True,
                    check=False,
                    pass_fds=[listener.fileno()],
                )
                if check.returncode != 0:
                    raise RuntimeError(f"haproxy refused the rendered config: {check.stdout}{check.stderr}")
                log = (self.workdir / "haproxy.log").open("w")
                self.haproxy = self._popen(
                    _ending_with_parent([haproxy, "-db", "-f", str(config)]),
                    stdout=log,
                    stderr=log,
                    pass_fds=[listener.fileno()],
                )
            self._wait_for_front()
            self.wait_until_up(timeout=30)
        except BaseException:
            self.stop()
            raise

    def _front_pem(self) -> Path | None:
        """The front's certificate chain and key joined in one file, readable by this user only."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both to terminate TLS at the front, or neither")
        if self.tls_cert is None:
            return None
        path = self.workdir / "front.pem"
        path.touch(mode=0o600)
        chain = self.tls_cert.read_bytes()
        path.write_bytes(chain + (b"" if chain.endswith(b"\n") else b"\n") + self.tls_key.read_bytes())
        return path

    def _popen(self, *args, **kwargs) -> subprocess.Popen:
        """subprocess.Popen, run on the front's own thread."""
        return self._spawner.submit(subprocess.Popen, *args, **kwargs).result()

    def _replica_ca_pem(self) -> bytes | None:
        return None if self.replica_ca is None else self.replica_ca.read_bytes()

    def replica_channel(self, index: int):
        """A blocking gRPC channel straight to replica `index` (0-based), past the front."""
        return replica_channel(self.started[index].address, self._replica_ca_pem())

    def kill_replica(self, index: int) -> None:
        """SIGKILL replica `index` (0-based) and reap it: it dies as in a crash, and the kernel closes its
        connections (HAProxy's among them) at once."""
        process = self.started[index].process
        process.kill()
        process.wait()

    def restart_replica(self, index: int, timeout: float | None = None) -> Replica:
        """Start replica `index` (0-based), which has exited, again: a new `loraswap serve` on a port the OS picks,
        put in the old one's slot (HAProxy's `server replicaN`, through `set server ... addr` on the runtime API:
        the same name and id, so the same points on the hash ring) once it is SERVING; returns when HAProxy's
        checks see it up (`rise` passed checks). Its log is replicaN.restartK.log beside the first one."""
        if self.started[index].process.poll() is None:
            raise RuntimeError(f"replica{index + 1} is still running: kill or stop it first")
        name = f"replica{index + 1}"
        self._restarts += 1
        log_path = self.workdir / f"{name}.restart{self._restarts}.log"
        replica = start_replica(self.serve_flags, log_path, self._env, self._popen)
        self.started[index] = replica
        ready_timeout = self.ready_timeout if timeout is None else timeout
        wait_serving(replica.address, ready_timeout, self._replica_ca_pem(), replica)
        answer = self.runtime_api(f"set server loraswap_replicas/{name} addr 127.0.0.1 port {replica.port}")
        if "changed" not in answer:
            raise RuntimeError(f"haproxy did not move {name} to port {replica.port}: {answer.strip()}")
        self.wait_until_up(timeout=30, replicas=[name])
        return replica

    def request_log(self) -> list[FrontLogLine]:
        """Every call HAProxy has logged so far (a call is logged when it ends), in the order they ended."""
        return parse_request_log((self.workdir / "haproxy.log").read_text(errors="replace"))

    def _wait_for_front(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.haproxy.poll() is not None:
                raise RuntimeError(f"haproxy exited: {(self.workdir / 'haproxy.log').read_text()[-2000:]}")
            if self.stats_socket.exists():
                with contextlib.suppress(OSError):
                    self.runtime_api("show info")
                    return
            time.sleep(0.05)
        raise TimeoutError("haproxy did not start")

    def runtime_api(self, command: str) -> str:
        """One command on HAProxy's runtime API (the stats socket)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.stats_socket))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def server_stats(self) -> dict[str, dict[str, str]]:
        """replica name -> its row of HAProxy's `show stat` by column name: `status` (UP, DOWN, MAINT, ...),
        `scur` (calls it has now), `stot` (calls it took), `check_status` (L7OK, L4CON, ...), ..."""
        lines = self.runtime_api("show stat").splitlines()
        columns = lines[0].removeprefix("# ").split(",")
        rows = (dict(zip(columns, line.split(","), strict=False)) for line in lines[1:] if line)
        return {
            row["svname"]: row
            for row in rows
            if row.get("pxname") == "loraswap_replicas" and row["svname"].startswith("replica")
        }

    def server_states(self) -> dict[str, str]:
        """replica name -> HAProxy's view of it: UP, DOWN, MAINT, ..."""
        return {name: row["status"] for name, row in self.server_stats().items()}

    def wait_until_up(self, timeout: float, replicas: list[str] | None = None) -> None:
        """Block until HAProxy's health checks see these replicas (default: all) UP, each after a passed check
        (HAProxy counts a server UP from the start, before its first check has run)."""
        wanted = replicas or [f"replica{i}" for i in range(1, len(self.started) + 1)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.server_stats()
            if all(
                name in stats and stats[name]["status"].startswith("UP") and stats[name]["check_status"] == "L7OK"
                for name in wanted
            ):
                return
            time.sleep(0.1)
        raise TimeoutError(f"haproxy does not see {wanted} up: {self.server_stats()}")

    def stop(self, remove_workdir: bool = False) -> None:
        """SIGTERM HAProxy and every replica; kill what has not exited after a few seconds; then remove the
        workdir if asked (the `with` block asks only for a folder it made)."""
        processes = ([self.haproxy] if self.haproxy else []) + [r.process for r in self.started]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        self._spawner.shutdown()
        if remove_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--front-port", type=int, default=50050, help="0: the OS picks")
    parser.add_argument("--front-cert", type=Path, help="PEM certificate chain: terminate TLS at the front")
    parser.add_argument("--front-key", type=Path, help="PEM private key of --front-cert")
    parser.add_argument(
        "--replica-ca",
        type=Path,
        help="PEM CA of the replicas' certificates: they serve TLS (give --tls-cert/--tls-key after --)",
    )
    parser.add_argument("serve_flags", nargs="*", help="flags for every `loraswap serve` (after --)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    front = LocalFront(
        replicas=args.replicas,
        serve_flags=args.serve_flags,
        front_port=args.front_port,
        tls_cert=args.front_cert,
        tls_key=args.front_key,
        replica_ca=args.replica_ca,
        keep_workdir=True,
    )
    with front:
        print(json.dumps({"front": front.address, "replicas": [r.address for r in front.started],
                          "workdir": str(front.workdir)}), flush=True)  # fmt: skip
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
