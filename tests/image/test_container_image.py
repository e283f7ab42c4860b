"""The container image, built and run: the Dockerfile on a Debian base with a CPU torch, served through a port.

`make test-image` runs this module (.ci/run does, after `make test`, which leaves it out by its `image` marker).
Podman makes a bookworm base with debootstrap (cached in podman's image store under a tag keyed by its recipe),
builds the Dockerfile on it with the host's CA bundle as a build secret and the CPU torch wheel of the host pip's
find-links folder as the build context `wheels` (or the requirement in TORCH_SPEC), runs the image's own CMD on
`shapes`, waits for its HEALTHCHECK to say healthy, and draws through the published loopback port with the project's
client. Skips where podman cannot run, except in CI, where it must run. The figures (base, build, size, health,
stop) end pytest's report and go to out/container-image.json; the README quotes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.image, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/loraswap:cpu"
CONTAINER = f"loraswap-image-test-{os.getpid()}"
# crun and systemd's cgroup manager fail in this VM; runc with cgroupfs runs wherever rootful podman does.
PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager=cgroupfs")
# podman's default open-files limit (1048576) is above this VM's hard limit, and runc refuses to start then.
ULIMITS = ("--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096")

BASE_SUITE = "bookworm"
BASE_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3"
BASE_PYTHON_TAG = "cp311"  # bookworm's python3 is 3.11: the CPU torch wheel must be built for it
BASE_RECIPE = f"debootstrap --variant=minbase --include={BASE_PACKAGES} {BASE_SUITE} {BASE_MIRROR}"
# The recipe's hash in the tag: a changed recipe makes a new base instead of reusing a stale one.
BASE_IMAGE = f"localhost/debian-python3:{BASE_SUITE}-{hashlib.sha256(BASE_RECIPE.encode()).hexdigest()[:12]}"

CA_BUNDLE = Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
SECRET_PATH = "/run/secrets/ca-bundle"
# The container's grace period (`--stop-timeout`): the server drains for up to LORASWAP_GRACE_SECONDS (30 s), then
# exits; docker's default of 10 s would kill a busy one. deploy/kubernetes adds its preStop pause: 45 s.
STOP_TIMEOUT_S = 40
HEALTHY_WITHIN_S = 900  # the HEALTHCHECK's start period
HEALTH_PROBE = ["CMD", "python", "-m", "loraswap.server.healthcheck", "localhost:50051"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run podman with this VM's runtime settings; with `check`, fail with its stderr when it fails."""
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"podman {' '.join(args[:2])} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def missing(reason: str) -> None:
    """Skip for want of `reason`, except in CI, which must run these tests."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must build the image (.ci/run installs podman, runc and debootstrap)")
    pytest.skip(reason)


def host_find_links() -> list[Path]:
    """The folders this machine's pip finds wheels in (its find-links, from the environment or its config)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    values = re.findall(r"^\S*find-links='(.*)'$", listing, flags=re.MULTILINE)
    values.append(os.environ.get("PIP_FIND_LINKS", ""))
    return list(dict.fromkeys(Path(value) for line in values for value in line.split() if Path(value).is_dir()))


def cpu_torch() -> tuple[Path | None, str]:
    """The folder to mount as the build context `wheels` (None: none) and the torch requirement pip installs."""
    spec = os.environ.get("TORCH_SPEC")
    for folder in host_find_links():
        wheels = sorted(folder.glob(f"torch-*+cpu-{BASE_PYTHON_TAG}-*.whl"))
        if wheels:
            return folder, spec or f"torch=={wheels[-1].name.split('-')[1]}"
    if spec is None:
        missing(
            f"no CPU torch for the image: no torch-*+cpu-{BASE_PYTHON_TAG} wheel in pip's find-links, no TORCH_SPEC"
        )
    return None, spec


@pytest.fixture(scope="module")
def podman_ready() -> None:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        missing("podman or runc is not installed (apt-get install podman runc debootstrap)")
    if os.geteuid() != 0:
        missing("the image tests need root: rootful podman, and debootstrap for the base")
    info = subprocess.run([*PODMAN, "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        missing(f"podman cannot run here: {info.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def base_image(podman_ready, image_figures) -> str:
    """A bookworm minbase with python3, imported into podman with no registry; made once per recipe."""
    image_figures["base_image"] = BASE_IMAGE
    if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        image_figures["base_seconds"] = "cached"
        return BASE_IMAGE
    if shutil.which("debootstrap") is None:
        missing("debootstrap is not installed (apt-get install debootstrap)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="loraswap-base-", dir="/var/tmp") as workdir:
        root = Path(workdir) / "root"
        made = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", BASE_SUITE, str(root), BASE_MIRROR],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert made.returncode == 0, f"debootstrap failed:\n{made.stdout[-3000:]}\n{made.stderr[-3000:]}"
        # The package lists are stale by the next build, which runs apt-get update anyway: 90 MB for nothing.
        for leftover in [*(root / "var/lib/apt/lists").glob("*"), *(root / "var/cache/apt").glob("*.bin")]:
            if leftover.is_file():
                leftover.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            [*PODMAN, "import", "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True, check=False
        )
        tar.stdout.close()
        assert tar.wait() == 0 and imported.returncode == 0, f"podman import failed: {imported.stderr[-2000:]!r}"
    image_figures["base_seconds"] = round(time.monotonic() - started, 1)
    return BASE_IMAGE


def build_command(base: str, wheels: Path | None, torch_spec: str) -> list[str]:
    """The README's `podman build` for a CPU image on `base`."""
    # --format docker: an OCI image config has no HEALTHCHECK, and podman would drop it.
    command = ["build", "--format", "docker", *ULIMITS, "--build-arg", f"BASE_IMAGE={base}"]
    if wheels is not None:
        command += ["--build-context", f"wheels={wheels}"]
    command += ["--build-arg", f"TORCH_SPEC={torch_spec}"]
    if CA_BUNDLE.is_file():
        command += ["--secret", f"id=ca-bundle,src={CA_BUNDLE}", "--build-arg", f"PIP_CERT={SECRET_PATH}"]
    return [*command, "-t", IMAGE, str(REPO)]


@pytest.fixture(scope="module")
def built_image(base_image, image_figures, tmp_path_factory) -> str:
    wheels, torch_spec = cpu_torch()
    log_path = tmp_path_factory.mktemp("image") / "build.log"
    previous = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    started = time.monotonic()
    with log_path.open("w") as log:
        built = subprocess.run(
            [*PODMAN, *build_command(base_image, wheels, torch_spec)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=2700,
            check=False,
        )
    seconds = time.monotonic() - started
    output = log_path.read_text()
    assert built.returncode == 0, f"podman build exited {built.returncode} (log: {log_path}):\n{output[-6000:]}"
    if previous and previous != podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip():
        # The image this build replaced holds gigabytes no tag names any more (refused while a container uses it).
        podman("rmi", previous, check=False)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    torch_version = podman("run", "--rm", *ULIMITS, IMAGE, "python", "-c", "import torch; print(torch.__version__)")
    image_figures.update(
        torch_spec=torch_spec,
        torch_in_image=torch_version.stdout.strip(),
        build_seconds=round(seconds, 1),
        build_steps=len(re.findall(r"^\[\d+/\d+\] STEP ", output, flags=re.MULTILINE)),
        build_steps_cached=output.count("--> Using cache"),
        image_bytes=size,
        image_mb=round(size / 1e6),
    )
    return IMAGE


def container_log(name: str) -> str:
    """The end of what the container wrote (the server logs to stderr, its serving line to stdout)."""
    logs = podman("logs", "--tail", "40", name, check=False)
    return (logs.stdout + logs.stderr)[-4000:]


@pytest.fixture(scope="module")
def serving_container(built_image, image_figures):
    """The image's own CMD on `shapes`, its port published on loopback at a port the OS picks, once healthy.

    Yields (name, host port). Podman schedules HEALTHCHECKs with systemd timers, and there is no systemd here, so
    the test runs the image's HEALTHCHECK itself (`podman healthcheck run`) until it passes.
    """
    started = time.monotonic()
    podman(
        "run", "-d", "--name", CONTAINER, *ULIMITS, "--stop-timeout", str(STOP_TIMEOUT_S),
        "-p", "127.0.0.1::50051",
        # shapes brings its own adapters; the image's /adapters is for mounted ones.
        "-e", "MODEL_ID=shapes", "-e", "LORASWAP_ADAPTER_DIR=",
        built_image,
    )  # fmt: skip
    try:
        port = int(podman("port", CONTAINER, "50051/tcp").stdout.strip().rsplit(":", 1)[1])
        while podman("healthcheck", "run", CONTAINER, check=False).returncode != 0:
            running = podman("inspect", "--format", "{{.State.Running}}", CONTAINER).stdout.strip()
            assert running == "true", f"the container stopped before it was healthy:\n{container_log(CONTAINER)}"
            assert time.monotonic() - started < HEALTHY_WITHIN_S, f"not healthy in time:\n{container_log(CONTAINER)}"
            time.sleep(2)
        image_figures["healthy_seconds"] = round(time.monotonic() - started, 1)
        yield CONTAINER, port
    finally:
        podman("rm", "--force", "--time", "0", CONTAINER, check=False)


def test_build_leaves_no_ca_bundle_and_no_build_setting_in_the_image(built_image) -> None:
    if not CA_BUNDLE.is_file():
        pytest.skip(f"no CA bundle at {CA_BUNDLE} was given to the build")
    config = json.loads(podman("image", "inspect", built_image).stdout)[0]["Config"]
    assert not [variable for variable in config["Env"] if variable.startswith(("PIP_CERT=", "TORCH_SPEC="))]
    bundle_digest = hashlib.sha256(CA_BUNDLE.read_bytes()).hexdigest()
    same_size = podman(
        "run", "--rm", *ULIMITS, "--user", "0", built_image,
        "find", "/", "-xdev", "-type", "f", "-size", f"{CA_BUNDLE.stat().st_size}c", "-exec", "sha256sum", "{}", "+",
    ).stdout  # fmt: skip
    assert bundle_digest not in same_size, f"the build secret was written into a layer:\n{same_size}"


def test_healthcheck_is_the_project_probe_and_reports_healthy(serving_container) -> None:
    name, _ = serving_container
    state = json.loads(podman("inspect", name).stdout)[0]
    assert state["Config"]["Healthcheck"]["Test"] == HEALTH_PROBE
    assert state["State"]["Health"]["Status"] == "healthy"
    assert state["State"]["Health"]["Log"][-1]["Output"].strip() == "SERVING"


def test_client_draws_through_the_published_port(serving_container, image_figures) -> None:
    from training.shapes_classifier import classify_image

    from loraswap.client import LoraswapClient
    from tests.support.images import decode

    _, port = serving_container
    with LoraswapClient(f"127.0.0.1:{port}", default_timeout=300) as client:
        info = client.server_info()
        started = time.monotonic()
        base = client.generate_image("a red circle on a blue background", seed=1)
        image_figures["first_generate_seconds"] = round(time.monotonic() - started, 2)
        outlined = client.generate_image("a red circle on a blue background", adapter="outline", seed=1)
        image_figures["recompilations_after_two_generates"] = client.server_info().recompilations
    assert (info.model, info.device, info.compiled) == ("shapes", "cpu", True)
    assert (base.mime_type, base.width, base.height) == ("image/png", 64, 64)
    base_reading = classify_image(decode(base.data).astype("uint8"))
    outline_reading = classify_image(decode(outlined.data).astype("uint8"))
    image_figures["generated"] = {"base": repr(base_reading), "outline": repr(outline_reading)}
    assert base_reading.matches("circle", "red", "blue"), base_reading
    assert outlined.adapter == "outline" and outline_reading.matches("circle", "red", "blue", hollow=True)


def test_server_is_the_main_process_and_not_root(serving_container) -> None:
    name, _ = serving_container
    status = podman("exec", name, "cat", "/proc/1/status").stdout
    uids = re.search(r"^Uid:\s+(.*)$", status, flags=re.MULTILINE).group(1).split()
    assert set(uids) == {"10001"}, status
    # PID 1 is the server itself (the CMD's `exec`), so `docker stop`'s SIGTERM reaches it and not a shell.
    argv = podman("exec", name, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert argv[1:4] == ["/opt/venv/bin/loraswap", "serve", "--model"], argv


def test_sigterm_stops_the_container_within_its_grace_period_with_exit_code_0(serving_container, image_figures) -> None:
    name, _ = serving_container
    started = time.monotonic()
    podman("stop", name, timeout=STOP_TIMEOUT_S + 60)
    seconds = time.monotonic() - started
    exit_code = int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout)
    image_figures.update(stop_seconds=round(seconds, 2), exit_code=exit_code)
    # 137 (SIGKILL) would mean the grace period ran out first.
    assert exit_code == 0, container_log(name)
    assert seconds < STOP_TIMEOUT_S
    assert "stopping: draining" in container_log(name)
