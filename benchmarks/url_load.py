"""A cold Generate from an https:// URL against the same file from disk, side by side in one run.

    python -m benchmarks.url_load                               # shapes, rank 64
    python -m benchmarks.url_load --model random-flux --layers 1 --rank 64 --size 256

One in-process server (`--compile none`, port 0) serves both paths; a real nginx (Debian's, started here with a
CA made here: tests/support/web_servers.py) serves the adapter over HTTPS on loopback. Each repeat, in
alternating order:

- `disk`: a Generate naming the adapter under `--adapter-dir` (a name not in the host cache: read, convert,
  validate, swap, denoise);
- `url`: a Generate naming it by an https:// URL of a path fetched for the first time (no host-cache entry, no
  disk-cache record: TLS handshake, request, the body streamed to the disk cache with its SHA-256, fsync, rename,
  then the same read as `disk`);
- `transfer`: the same file fetched over a new HTTPS connection (httpcore, as the server's) into /dev/null: the
  link's time for it.

Every name is a hard link of one file, so every path reads bytes the page cache holds. The figure is
`url_over_disk_plus_transfer` = median(url) / (median(disk) + median(transfer)); goal <= 1.2. Times are the
client's wall clock around the whole call. The last line printed is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "a lighthouse at dusk"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_adapter(model: str, layers: int | None, rank: int, folder: Path) -> Path:
    from loraswap.server.devtools.random_adapter import write_random_adapter
    from loraswap.server.engine.models import builtin_model

    pipe = builtin_model(model).build(layers=layers)
    write_random_adapter(pipe, folder, rank=rank, seed=1, init_std=0.01)
    return folder / "pytorch_lora_weights.safetensors"


def transfer_s(url: str, ca_file: Path) -> float:
    """One fetch of `url` over a fresh HTTPS connection (httpcore, as the server's), the body read and dropped."""
    import ssl

    import httpcore

    context = ssl.create_default_context(cafile=str(ca_file))
    started = time.perf_counter()
    with httpcore.ConnectionPool(ssl_context=context) as pool, pool.stream("GET", url) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
        for _ in response.iter_stream():
            pass
    return time.perf_counter() - started


async def run(args, root: Path) -> dict:
    from tests.support.certificates import TestCertificateAuthority
    from tests.support.web_servers import NginxFileServer

    from loraswap.client import AsyncLoraswapClient
    from loraswap.server.app import start_server
    from loraswap.server.config import Settings
    from loraswap.server.engine.config import EngineConfig

    adapter = write_adapter(args.model, args.layers, args.rank, root / "made")
    size = adapter.stat().st_size
    local, served = root / "local", root / "served"
    local.mkdir()
    served.mkdir()
    for index in range(args.repeats + 1):
        for folder, stem in ((local, "disk"), (served, "url"), (served, "transfer")):
            os.link(adapter, folder / f"{stem}-{index}.safetensors")
    ca = TestCertificateAuthority("url_load benchmark CA")
    with NginxFileServer(served, ca) as web:
        settings = Settings(
            engine=EngineConfig(
                model=args.model, layers=args.layers, adapter_dir=local, max_rank=args.rank, compile="none",
                torch_threads=args.threads, allow_url_host=("127.0.0.1",), url_ca_file=web.ca_file,
                adapter_cache_dir=root / "cache", max_adapter_bytes=max(2 * size, 1 << 20),
            ),
            host="127.0.0.1",
            port=0,
        )  # fmt: skip
        running = await start_server(settings)
        try:
            async with AsyncLoraswapClient(f"127.0.0.1:{running.port}", default_timeout=3600) as client:
                sizes = {} if args.size is None else {"width": args.size, "height": args.size}

                async def generate_s(name: str) -> tuple[float, float]:
                    started = time.perf_counter()
                    image = await client.generate_image(
                        PROMPT, adapter=name, seed=1, num_inference_steps=args.steps, **sizes
                    )
                    return time.perf_counter() - started, image.timings.adapter_load_ms / 1000.0

                await generate_s("")  # the first request's one-off costs go to neither path
                await generate_s("disk-0")
                await generate_s(web.url("/files/url-0.safetensors"))
                await asyncio.to_thread(transfer_s, web.url("/files/transfer-0.safetensors"), web.ca_file)
                figures: dict[str, list[float]] = {"disk": [], "url": [], "transfer": [], "disk_load": [],
                                                   "url_load": []}  # fmt: skip
                for index in range(1, args.repeats + 1):
                    order = ("disk", "url", "transfer") if index % 2 else ("transfer", "url", "disk")
                    for path in order:
                        if path == "transfer":
                            url = web.url(f"/files/transfer-{index}.safetensors")
                            figures["transfer"].append(await asyncio.to_thread(transfer_s, url, web.ca_file))
                            continue
                        name = f"disk-{index}" if path == "disk" else web.url(f"/files/url-{index}.safetensors")
                        total, load = await generate_s(name)
                        figures[path].append(total)
                        figures[f"{path}_load"].append(load)
                    log(f"repeat {index}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in figures.items()))
        finally:
            await running.stop(5.0)
    median = {path: statistics.median(values) for path, values in figures.items()}
    return {
        "benchmark": "url_load",
        "model": args.model,
        "layers": args.layers,
        "rank": args.rank,
        "adapter_bytes": size,
        "steps": args.steps,
        "size": args.size,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": platform.machine(),
        "median_s": {path: round(value, 4) for path, value in median.items()},
        "samples_s": {path: [round(value, 4) for value in values] for path, values in figures.items()},
        "transfer_mb_per_s": round(size / median["transfer"] / 1e6, 1),
        "url_over_disk_plus_transfer": round(median["url"] / (median["disk"] + median["transfer"]), 3),
        "url_over_disk": round(median["url"] / median["disk"], 3),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.url_load",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="shapes", help="built-in model (default: shapes)")
    parser.add_argument("--layers", type=int, default=None, help="random-flux only: double-stream blocks kept")
    parser.add_argument("--rank", type=int, default=64, help="the adapter's rank (default: 64)")
    parser.add_argument("--steps", type=int, default=1, help="denoising steps of each Generate (default: 1)")
    parser.add_argument("--size", type=int, default=None, help="width and height (default: the model's)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats of each path (default: 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="url-load-") as folder:
        result = asyncio.run(run(args, Path(folder)))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
