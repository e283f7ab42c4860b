"""The CLI's tqdm progress bar (quiet off a terminal) and `loraswap --version`, with only the client installed."""

from __future__ import annotations

import io
from importlib.metadata import PackageNotFoundError, version

import pytest

from loraswap.client import command
from loraswap.client.cli import ProgressBar
from loraswap.client.events import Progress, Queued

EVENTS = [
    Queued(0, loading_adapter=True),
    Queued(0, loading_adapter=True, downloaded_bytes=3_100_000, download_total_bytes=7_900_000),
    Queued(2),
    Queued(1),
    Progress(1, 4, 10.0),
    Progress(4, 4, 40.0),
]


class TerminalStream(io.StringIO):
    """A text stream that says it is a terminal, as stderr is when a person watches."""

    def isatty(self) -> bool:
        return True


def _draw(stream: io.StringIO) -> str:
    bar = ProgressBar(stream)
    for event in EVENTS:
        bar.show(event)
    bar.finish()
    return stream.getvalue()


def test_progress_bar_draws_loading_queue_and_steps_on_a_terminal() -> None:
    drawn = _draw(TerminalStream())
    assert "loading adapter" in drawn and "queued: position 2" in drawn and "queued: position 1" in drawn
    assert "downloading adapter: 3.1 of 7.9 MB" in drawn
    assert "denoising" in drawn and "4/4" in drawn and drawn.endswith("\n")  # tqdm may skip redraws in between


def test_progress_bar_is_quiet_when_stderr_is_not_a_terminal() -> None:
    assert _draw(io.StringIO()) == ""


def test_version_prints_the_client_version_and_the_servers_when_installed(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        command.main(["--version"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"loraswap-client {version('loraswap-client')}")
    try:
        assert printed.endswith(f", loraswap-server {version('loraswap-server')}")
    except PackageNotFoundError:
        assert "loraswap-server" not in printed
