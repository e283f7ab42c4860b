"""One access line per DiffusionService call, when it ends, on the `loraswap.access` logger.

Fields (JSON keys, or key=value in text): request_id, method, code, reason, duration_ms; for calls about
adapters, adapter (a stack's members joined by commas); for Generate, steps, size (WIDTHxHEIGHT) and, once
an image came out, queue_ms, load_ms, swap_ms, denoise_ms and decode_ms from its timings and fused (whether its
adapters were merged into the base weights, --fuse); prompt only with
--log-prompts.
"""

from __future__ import annotations

import logging

from loraswap.server.observability.calls import CallRecord

ACCESS_LOGGER = "loraswap.access"
ADAPTER_METHODS = frozenset({"Generate", "PreloadAdapter", "Evict"})


def _ms(seconds_or_ms: float) -> float:
    return round(seconds_or_ms, 1)


def access_fields(record: CallRecord, *, log_prompts: bool) -> dict[str, object]:
    """The fields of the access line of `record`."""
    fields: dict[str, object] = {
        "request_id": record.request_id,
        "method": record.method,
        "code": record.code,
        "reason": record.reason,
        "duration_ms": _ms(record.duration_s * 1000.0),
    }
    if record.method in ADAPTER_METHODS:
        fields["adapter"] = ",".join(record.adapters)
    if record.method == "Generate":
        if record.steps is not None:
            fields["steps"] = record.steps
        if record.width is not None and record.height is not None:
            fields["size"] = f"{record.width}x{record.height}"
        timings = record.timings
        if timings is not None:
            fields.update(
                queue_ms=_ms(timings.queue_ms),
                load_ms=_ms(timings.adapter_load_ms),
                swap_ms=_ms(timings.adapter_swap_ms),
                denoise_ms=_ms(timings.denoise_ms),
                decode_ms=_ms(timings.decode_ms),
            )
        if record.fused is not None:
            fields["fused"] = record.fused
        if log_prompts:
            fields["prompt"] = record.prompt
    return fields


class AccessLog:
    """Writes the access line of each finished call."""

    def __init__(self, *, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts
        self._log = logging.getLogger(ACCESS_LOGGER)

    def call_ended(self, record: CallRecord) -> None:
        fields = access_fields(record, log_prompts=self.log_prompts)
        self._log.info("%s %s in %.1f ms", record.method, record.code, record.duration_s * 1000.0, extra=fields)
