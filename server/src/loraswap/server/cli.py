"""`loraswap serve`: the server's command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from loraswap.server.config import SettingsError, add_serve_arguments, settings_from_args

EXIT_BAD_SETTINGS = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser("serve", help="run the gRPC server")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0 after a graceful drain, 2 (one line on stderr) for unusable settings."""
    from loraswap.server.app import serve

    try:
        settings = settings_from_args(args)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        asyncio.run(serve(settings))
    except SettingsError as error:
        print(f"loraswap serve: {error}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    return 0
