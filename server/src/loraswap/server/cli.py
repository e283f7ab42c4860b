"""`loraswap serve`: the server's command line."""

from __future__ import annotations

import argparse
import asyncio
import logging

from loraswap.server.config import add_serve_arguments, settings_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser("serve", help="run the gRPC server")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0 after a graceful drain."""
    from loraswap.server.app import serve

    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings))
    return 0
