"""`loraswap serve`: the server's command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from loraswap.server.config import SettingsError, add_serve_arguments, settings_from_args
from loraswap.server.engine.errors import StartupError

EXIT_STOPPED = 0
EXIT_BAD_SETTINGS = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser("serve", help="run the gRPC server")
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0 after a graceful drain or a stop during start-up, 2 (one line on stderr)
    for unusable settings (and for --preload / --pin adapters it cannot load)."""
    # SIGTERM acts as SIGINT until serve() takes both over: a stop during the imports (seconds) exits 0 too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        from loraswap.server.engine.quiet_imports import quiet_foreign_packages

        # First, before the settings' checks or the app import diffusers: what is kept out must not be in yet.
        quiet_foreign_packages(args.quantize if isinstance(args.quantize, str) else "none")
        from loraswap.server.app import serve
        from loraswap.server.engine.pipeline.preflight import preflight
        from loraswap.server.observability.log_format import configure_logging

        settings = settings_from_args(args)
        # What this machine cannot serve (--quantize fp8 without CUDA, an unknown --attention) stops here, before
        # the server listens or a model loads.
        preflight(settings.engine)
        configure_logging(settings.log_level, settings.log_format)
        threads_ended = asyncio.run(serve(settings))
    except KeyboardInterrupt:
        print("loraswap serve: stopped before listening", file=sys.stderr)
        return EXIT_STOPPED
    except (SettingsError, StartupError) as error:
        print(f"loraswap serve: {error}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    if not threads_ended:
        # The engine's worker is still inside torch: finalizing the interpreter now would end that thread
        # mid-call and abort (SIGABRT, scheduler.py says why). Leave at once, the log written out.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(EXIT_STOPPED)
    return EXIT_STOPPED
