"""The `loraswap` command: serve, the client commands, and the offline tools."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from loraswap import demo, tools_cli
    from loraswap.client import cli as client_cli
    from loraswap.server import cli as server_cli

    parser = argparse.ArgumentParser(prog="loraswap", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    server_cli.register(subparsers)
    client_cli.register(subparsers)
    tools_cli.register(subparsers)
    demo.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `loraswap` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
