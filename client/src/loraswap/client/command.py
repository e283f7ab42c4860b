"""The `loraswap` command: the client commands, plus those an installed server distribution adds.

The client distribution owns the console script, so that a microservice that
installs only the client still gets `loraswap generate|preload|evict|adapters|info`.
The server distribution (loraswap-server) registers its commands (serve, demo,
export-model, make-adapter) under the `loraswap.commands` entry-point group;
nothing here imports the server. Without it those commands say, in one line,
what to install.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version

from loraswap.client import cli as client_cli

COMMAND_GROUP = "loraswap.commands"
CLIENT_DISTRIBUTION = "loraswap-client"
SERVER_DISTRIBUTION = "loraswap-server"
SERVER_COMMANDS = ("serve", "demo", "export-model", "make-adapter")
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: client commands, installed plug-ins, and a pointer for missing server commands."""
    parser = argparse.ArgumentParser(
        prog="loraswap", description="A client (and, when installed, the server) of loraswap."
    )
    parser.add_argument("--version", action="version", version=version_text())
    subparsers = parser.add_subparsers(dest="command", required=True)
    client_cli.register(subparsers)
    for entry_point in sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name):
        entry_point.load()(subparsers)
    for name in SERVER_COMMANDS:
        if name not in subparsers.choices:
            _register_missing(subparsers, name)
    return parser


def version_text() -> str:
    """``loraswap-client X`` and, when the server distribution is installed, ``, loraswap-server Y``."""
    parts = []
    for distribution in (CLIENT_DISTRIBUTION, SERVER_DISTRIBUTION):
        try:
            parts.append(f"{distribution} {version(distribution)}")
        except PackageNotFoundError:
            if distribution == CLIENT_DISTRIBUTION:
                parts.append(f"{distribution} (not installed: running from a source tree)")
    return ", ".join(parts)


def _register_missing(subparsers: argparse._SubParsersAction, name: str) -> None:
    stub = subparsers.add_parser(name, help=f"needs the server distribution ({SERVER_DISTRIBUTION})", add_help=False)
    stub.set_defaults(func=lambda args: _missing_server(name), server_missing=True)


def _missing_server(name: str) -> int:
    print(
        f"loraswap {name}: needs the server, which is not installed here; "
        f"pip install {SERVER_DISTRIBUTION} (./server in the repository)",
        file=sys.stderr,
    )
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `loraswap` console script."""
    parser = build_parser()
    # A missing server command takes whatever flags were meant for it, and answers with one line.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "server_missing", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
