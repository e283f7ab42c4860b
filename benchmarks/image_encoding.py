"""What writing a generated image costs: each file format and setting on noise-like and photo-like pictures.

    python -m benchmarks.image_encoding                  # 1024x1024, 5 repeats
    python -m benchmarks.image_encoding --size 2048 --repeats 3

Two RGB pictures, made here from a seed: `noise` (uniform random pixels: no encoder can shrink them, so it shows
the cost of passing the bytes through) and `photo` (a 1/f^1.5 amplitude spectrum, the statistics of natural images,
plus a little per-pixel grain: PNG keeps it at about half its raw size, as it does a photograph or a diffusion
model's 1024² output). Each is saved with Pillow into memory by every setting below; times are the median and the
least of `--repeats` runs on one core (Pillow encodes on the calling thread).

- `png_level_N`: PNG at compress_level N with Pillow's default strategy (Z_FILTERED); `png_level_6` is Pillow's
  default, what the server wrote before it chose by this measurement;
- `png_rle_level_N`: the same with zlib's run-length strategy (compress_type 3);
- `jpeg_q95`, `webp_lossless_method_M_quality_Q` (method 4, quality 80 is Pillow's default);
- `served_png`, `served_jpeg`, `served_webp`: what the server writes (engine/pipeline/image_encoding.py).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import time

PNG_LEVELS = range(10)
WEBP_EFFORTS = ((0, 0), (1, 25), (2, 50), (4, 80))  # (method, quality)


def noise_picture(size: int, seed: int = 0):
    """Uniform random RGB pixels."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8))


def photo_picture(size: int, seed: int = 0, slope: float = 1.5, grain: float = 1.0):
    """A picture with natural images' statistics: amplitude falling as 1/f^slope, channels correlated, grain added."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    frequency = np.hypot(np.fft.fftfreq(size)[:, None], np.fft.rfftfreq(size)[None, :])
    frequency[0, 0] = 1.0
    channels = []
    for _ in range(3):
        spectrum = (rng.standard_normal(frequency.shape) + 1j * rng.standard_normal(frequency.shape)) / frequency**slope
        spectrum[0, 0] = 0.0
        channels.append(np.fft.irfft2(spectrum, s=(size, size)))
    shared = channels[0]  # natural colours move together: most of each channel is the shared luminance
    picture = np.stack([0.7 * shared + 0.3 * channel for channel in channels], axis=-1)
    picture = (picture - picture.mean()) / picture.std() * 45.0 + 120.0 + rng.normal(0.0, grain, picture.shape)
    return Image.fromarray(np.clip(picture, 0, 255).round().astype(np.uint8))


def settings() -> dict[str, dict]:
    """Every setting measured: a name -> Pillow's save() options."""
    from loraswap.server.engine.pipeline.image_encoding import SAVE_OPTIONS, Z_RLE

    measured: dict[str, dict] = {}
    for level in PNG_LEVELS:
        measured[f"png_level_{level}"] = {"format": "PNG", "compress_level": level}
    for level in PNG_LEVELS:
        measured[f"png_rle_level_{level}"] = {"format": "PNG", "compress_level": level, "compress_type": Z_RLE}
    measured["jpeg_q95"] = {"format": "JPEG", "quality": 95}
    for method, quality in WEBP_EFFORTS:
        options = {"format": "WEBP", "lossless": True, "method": method, "quality": quality}
        measured[f"webp_lossless_method_{method}_quality_{quality}"] = options
    for image_format, options in SAVE_OPTIONS.items():
        measured[f"served_{image_format.value}"] = dict(options)
    return measured


def measure(picture, options: dict, repeats: int) -> dict:
    times, size = [], 0
    for _ in range(repeats):
        buffer = io.BytesIO()
        started = time.perf_counter()
        picture.save(buffer, **options)
        times.append(time.perf_counter() - started)
        size = buffer.tell()
    raw = picture.width * picture.height * 3
    return {
        "median_ms": round(statistics.median(times) * 1000.0, 1),
        "min_ms": round(min(times) * 1000.0, 1),
        "bytes": size,
        "of_raw": round(size / raw, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.image_encoding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="the pictures' side in pixels")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each setting on each picture")
    parser.add_argument("--only", default="", help="comma-separated setting names to measure (default: all)")
    args = parser.parse_args()
    import PIL
    from PIL import features

    chosen = settings()
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    pictures = {"noise": noise_picture(args.size), "photo": photo_picture(args.size)}
    results = {name: {setting: measure(picture, options, args.repeats) for setting, options in chosen.items()}
               for name, picture in pictures.items()}  # fmt: skip
    print(
        json.dumps({
            "benchmark": "image_encoding",
            "size": args.size,
            "repeats": args.repeats,
            "pillow": PIL.__version__,
            "zlib": features.version("zlib"),
            "zlib_ng": features.version("zlib_ng") if features.check("zlib_ng") else None,
            "libwebp": features.version("webp"),
            "machine": platform.machine(),
            "processor": _processor(),
            "settings": chosen,
            "pictures": results,
        }),
        flush=True,
    )  # fmt: skip


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
