"""The user commands of the ``loraswap`` CLI: generate, preload, evict, adapters, info.

Results go to stdout as JSON, progress and errors to stderr, so that output
can be piped into ``jq`` while a person still watches the progress bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from loraswap.client.aio import DEFAULT_TARGET, ImageFormat, missing_image_error
from loraswap.client.connection import TlsConfig
from loraswap.client.errors import InvalidRequest, LoraswapError
from loraswap.client.events import GeneratedImage, Progress, Queued
from loraswap.client.sync import LoraswapClient

__all__ = ["ProgressBar", "register"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

_FORMAT_BY_SUFFIX: dict[str, ImageFormat] = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}

CommandFunc = Callable[[argparse.Namespace], int]

# The environment variable the CLI takes its bearer token from when --token is not given.
TOKEN_ENV = "LORASWAP_TOKEN"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the client subcommands to ``subparsers``; each sets ``func(args) -> exit code``."""
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument(
        "--server",
        default=DEFAULT_TARGET,
        metavar="HOST:PORT",
        help=f"address of the loraswap server (default: {DEFAULT_TARGET})",
    )
    connection.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="deadline for the call; 0 for none (default: 300)",
    )
    connection.add_argument(
        "--wait",
        action="store_true",
        help="wait, up to the deadline, for a server that is not up yet instead of failing at once",
    )
    connection.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        metavar="TOKEN",
        help=f"bearer token for servers run with --auth-token-file (default: ${TOKEN_ENV}, "
        "which keeps it out of the process list)",
    )
    connection.add_argument(
        "--tls", action="store_true", help="connect with TLS, trusting the system's root certificates"
    )
    connection.add_argument(
        "--tls-ca", type=_pem_file, metavar="PEM", help="connect with TLS, trusting the CA certificates in PEM"
    )
    connection.add_argument(
        "--tls-cert", type=_pem_file, metavar="PEM", help="client certificate for mTLS (with --tls-key; implies TLS)"
    )
    connection.add_argument("--tls-key", type=_pem_file, metavar="PEM", help="private key of --tls-cert")

    generate = subparsers.add_parser(
        "generate",
        parents=[connection],
        help="generate one image",
        description="Generate one image, showing progress on stderr; print a JSON summary on stdout.",
    )
    generate.add_argument("prompt", help="the text prompt")
    generate.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        default=[],
        type=_adapter_argument,
        metavar="NAME[:SCALE]",
        help="LoRA adapter to apply, optionally with its strength; repeat it to stack adapters "
        "(--adapter ink:0.8 --adapter paper:0.5) (default: base model)",
    )
    generate.add_argument(
        "--scale", dest="adapter_scale", type=float, metavar="S", help="strength of a single --adapter (default: 1.0)"
    )
    generate.add_argument("--steps", dest="num_inference_steps", type=int, metavar="N", help="denoising steps")
    generate.add_argument("--guidance", dest="guidance_scale", type=float, metavar="G", help="guidance scale")
    generate.add_argument("--width", type=int, metavar="W", help="image width in pixels")
    generate.add_argument("--height", type=int, metavar="H", help="image height in pixels")
    generate.add_argument("--seed", type=int, metavar="S", help="noise seed (default: the server picks one)")
    generate.add_argument("--negative", dest="negative_prompt", default="", metavar="TEXT", help="negative prompt")
    generate.add_argument(
        "--format",
        dest="image_format",
        choices=("png", "jpeg", "webp"),
        help="image encoding (default: from the -o suffix, else png)",
    )
    generate.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="PATH",
        help="where to write the image (default: ./loraswap-SEED.EXT)",
    )
    generate.add_argument(
        "--preview",
        type=Path,
        metavar="DIR",
        help="ask for a preview of every step and write them to DIR as step-0001.jpg, ... (default: none)",
    )
    generate.add_argument(
        "--fuse",
        choices=("fused", "unfused"),
        help="pin how the adapters are applied: merged into the base weights, or in the swap slot "
        "(default: the server's --fuse policy)",
    )
    generate.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    generate.set_defaults(func=run_generate)

    preload = subparsers.add_parser("preload", parents=[connection], help="load and cache an adapter ahead of use")
    preload.add_argument("adapter", metavar="NAME", help="the adapter to load")
    preload.set_defaults(func=run_preload)

    evict = subparsers.add_parser("evict", parents=[connection], help="drop an adapter from the server's caches")
    evict.add_argument("adapter", metavar="NAME", help="the adapter to drop")
    evict.set_defaults(func=run_evict)

    adapters = subparsers.add_parser("adapters", parents=[connection], help="list the cached adapters")
    adapters.set_defaults(func=run_adapters)

    info = subparsers.add_parser("info", parents=[connection], help="describe the server's model and defaults")
    info.set_defaults(func=run_info)


def _adapter_argument(text: str) -> tuple[str, float | None]:
    """``NAME`` or ``NAME:SCALE``. Hub references hold colons too, so only a number after the last one is a scale;
    in a URL, only one after its host (``https://host:8443`` is a port)."""
    name, colon, suffix = text.rpartition(":")
    if "://" in name and "/" not in name.split("://", 1)[1]:
        return text, None
    if colon and name:
        try:
            return name, float(suffix)
        except ValueError:
            pass
    return text, None


def _adapter_fields(args: argparse.Namespace) -> dict[str, object]:
    """The generate arguments for the --adapter options: one adapter as ``adapter``, several as a stack."""
    if len(args.adapters) == 1:
        name, scale = args.adapters[0]
        if scale is not None and args.adapter_scale is not None:
            raise InvalidRequest(f"--adapter {name}:{scale} and --scale both give a strength; use one of them")
        return {"adapter": name, "adapter_scale": scale if scale is not None else args.adapter_scale}
    if args.adapter_scale is not None:
        raise InvalidRequest("--scale applies to a single --adapter; give each stacked adapter its own as NAME:SCALE")
    return {"adapters": args.adapters}


def _reporting_errors(command: CommandFunc) -> CommandFunc:
    """Turns failures into one line on stderr and an exit code instead of a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except LoraswapError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return run


def _pem_file(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None


def _tls_config(args: argparse.Namespace) -> TlsConfig | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise InvalidRequest("--tls-cert and --tls-key go together: give both for mTLS, or neither")
    if not (args.tls or args.tls_ca or args.tls_cert):
        return None
    return TlsConfig(ca_bundle=args.tls_ca, client_certificate=args.tls_cert, client_key=args.tls_key)


def _connect(args: argparse.Namespace) -> LoraswapClient:
    return LoraswapClient(
        args.server,
        default_timeout=args.timeout if args.timeout > 0 else None,
        wait_for_ready=args.wait,
        token=args.token,
        tls=_tls_config(args),
    )


def _print_json(value: object, *, indent: int | None = 2) -> None:
    print(json.dumps(value, indent=indent))


class ProgressBar:
    """A generation's progress as a tqdm bar: "loading adapter" or the queue position, then the steps.

    It draws nothing when the stream is not a terminal (tqdm's ``disable=None``), so logs and pipes stay clean.
    """

    def __init__(self, stream: TextIO) -> None:
        # While waiting there is nothing to count: the line is the description alone until the first step.
        self._bar = tqdm(file=stream, disable=None, unit="step", dynamic_ncols=True, bar_format="{desc}")

    def show(self, event: Queued | Progress) -> None:
        """Redraws the bar for a queue event or a completed step."""
        if isinstance(event, Queued):
            waiting = "loading adapter" if event.loading_adapter else f"queued: position {event.position}"
            if event.downloaded_bytes or event.download_total_bytes:
                total = f" of {event.download_total_bytes / 1e6:.1f}" if event.download_total_bytes else ""
                waiting = f"downloading adapter: {event.downloaded_bytes / 1e6:.1f}{total} MB"
            self._bar.set_description_str(waiting)
            return
        if self._bar.total != event.total_steps:
            self._bar.bar_format = None  # tqdm's own bar, counts, elapsed time and rate
            self._bar.set_description_str("denoising", refresh=False)
            self._bar.reset(total=event.total_steps)
        self._bar.update(event.step - self._bar.n)

    def finish(self) -> None:
        """Ends the bar's line so that later output starts on a fresh one."""
        self._bar.close()


def _image_format(args: argparse.Namespace) -> ImageFormat:
    if args.image_format is not None:
        return args.image_format
    if args.output is not None:
        return _FORMAT_BY_SUFFIX.get(args.output.suffix.lower(), "png")
    return "png"


def _image_summary(image: GeneratedImage, output: Path) -> dict[str, object]:
    return {
        "output": str(output),
        "seed": image.seed,
        "adapter": image.adapter,
        "adapter_scale": image.adapter_scale,
        "adapters": [dataclasses.asdict(applied) for applied in image.adapters],
        "fused": image.fused,
        "changed_components": list(image.changed_components),
        "width": image.width,
        "height": image.height,
        "mime_type": image.mime_type,
        "bytes": len(image.data),
        "timings": dataclasses.asdict(image.timings),
        "warnings": list(image.warnings),
    }


@_reporting_errors
def run_generate(args: argparse.Namespace) -> int:
    """``loraswap generate``: streams one generation, writes the image, prints a JSON summary."""
    adapter_fields = _adapter_fields(args)
    if args.preview is not None:
        try:
            args.preview.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"error: cannot make the preview folder {args.preview}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_FAILED
    previews: list[str] = []
    progress_bar = None if args.quiet else ProgressBar(sys.stderr)
    image: GeneratedImage | None = None
    with _connect(args) as client:
        try:
            for event in client.generate(
                args.prompt,
                **adapter_fields,
                num_inference_steps=args.num_inference_steps,
                guidance_scale=args.guidance_scale,
                width=args.width,
                height=args.height,
                seed=args.seed,
                negative_prompt=args.negative_prompt,
                image_format=_image_format(args),
                preview_every=1 if args.preview is not None else 0,
                fuse=args.fuse,
            ):
                if isinstance(event, GeneratedImage):
                    image = event
                    continue
                if isinstance(event, Progress) and event.preview and args.preview is not None:
                    path = args.preview / f"step-{event.step:04d}.{event.preview_extension}"
                    try:
                        path.write_bytes(event.preview)
                    except OSError as exc:
                        print(f"error: cannot write the preview {path}: {exc.strerror or exc}", file=sys.stderr)
                        return EXIT_FAILED
                    previews.append(str(path))
                if progress_bar is not None:
                    progress_bar.show(event)
        finally:
            if progress_bar is not None:
                progress_bar.finish()
    if image is None:
        raise missing_image_error()
    output = args.output if args.output is not None else Path(f"loraswap-{image.seed}.{image.extension}")
    try:
        image.save(output)
    except OSError as exc:
        print(f"error: cannot write the image to {output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    summary = _image_summary(image, output)
    if args.preview is not None:
        summary["previews"] = previews
    _print_json(summary, indent=None)
    return EXIT_OK


@_reporting_errors
def run_preload(args: argparse.Namespace) -> int:
    """``loraswap preload NAME``: caches an adapter and prints what the server learned about it."""
    with _connect(args) as client:
        result = client.preload_adapter(args.adapter)
    _print_json(dataclasses.asdict(result))
    return EXIT_OK


@_reporting_errors
def run_evict(args: argparse.Namespace) -> int:
    """``loraswap evict NAME``: drops an adapter from the caches and prints the bytes freed."""
    with _connect(args) as client:
        freed_bytes = client.evict(args.adapter)
    _print_json({"adapter": args.adapter, "freed_bytes": freed_bytes})
    return EXIT_OK


@_reporting_errors
def run_adapters(args: argparse.Namespace) -> int:
    """``loraswap adapters``: prints the server's adapter cache."""
    with _connect(args) as client:
        adapters = client.list_adapters()
    _print_json(dataclasses.asdict(adapters))
    return EXIT_OK


@_reporting_errors
def run_info(args: argparse.Namespace) -> int:
    """``loraswap info``: prints the server's model, swap slot and request defaults."""
    with _connect(args) as client:
        info = client.server_info()
    _print_json(dataclasses.asdict(info))
    return EXIT_OK
