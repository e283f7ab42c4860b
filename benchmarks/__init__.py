"""Benchmarks that print one JSON object as their last line; see BENCHMARKS.md.

Run them from the repository root as modules: ``python -m benchmarks.swap``
(adapter swap paths against diffusers' own, on a full-size random SDXL UNet)
and ``python -m benchmarks.serve`` (end to end over gRPC against a real server).
"""
