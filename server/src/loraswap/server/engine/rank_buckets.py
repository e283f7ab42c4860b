"""--rank-buckets: the ranks the swap slot computes at, so that a request pays about its own adapter's rank.

The slot holds max-rank factors on every layer, but a compiled graph computes with only the first
`bucket` ranks of them: the smallest bucket at or above the resident adapter's rank (a stack's:
its summed rank on its fullest layer), or none at all for the base model, which skips the LoRA
branch. Each bucket is a graph of its own, compiled during warm-up, so start-up pays one more
warm-up pass per bucket; see BENCHMARKS.md (`benchmarks/lora_tax.py`) for how the default was
chosen. Plain integers here, no torch: the front end validates flags with it.
"""

from __future__ import annotations

import itertools

# Below this rank a smaller bucket saves too little per step to pay for its own warm-up pass (BENCHMARKS.md).
SMALLEST_DEFAULT_BUCKET = 16


def default_rank_buckets(max_rank: int) -> tuple[int, ...]:
    """The buckets a slot of `max_rank` uses unless told: 16, then each doubling, up to max_rank (e.g. 16, 32, 64)."""
    buckets = []
    bucket = SMALLEST_DEFAULT_BUCKET
    while bucket < max_rank:
        buckets.append(bucket)
        bucket *= 2
    return (*buckets, max_rank)


def parse_rank_buckets(text: str) -> tuple[int, ...] | None:
    """`16,32,64` -> (16, 32, 64); empty -> None (the default). Raises ValueError (one line) for a non-integer."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        return None
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise ValueError(
            f"--rank-buckets {text!r} is not a comma-separated list of ranks; give e.g. --rank-buckets 16,32,64"
        ) from None


def resolve_rank_buckets(requested: tuple[int, ...] | None, max_rank: int) -> tuple[int, ...]:
    """The slot's buckets: `requested` checked (max_rank appended when it is not the last), or the default.

    Raises:
        ValueError: a bucket below 1 or above max_rank, or buckets not in strictly ascending order;
            the message is one line that says what to change.
    """
    if requested is None or len(requested) == 0:
        return default_rank_buckets(max_rank)
    shown = ",".join(str(bucket) for bucket in requested)
    for bucket in requested:
        if bucket < 1 or bucket > max_rank:
            raise ValueError(
                f"--rank-buckets {shown}: bucket {bucket} is outside 1..{max_rank} (--max-rank); "
                "give ranks from 1 up to --max-rank"
            )
    if any(later <= earlier for earlier, later in itertools.pairwise(requested)):
        raise ValueError(f"--rank-buckets {shown}: give the buckets in ascending order, each once (e.g. 16,32,64)")
    return tuple(requested) if requested[-1] == max_rank else (*requested, max_rank)


def bucket_for(rank: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding `rank` ranks (0 for rank 0: the base model computes no LoRA branch)."""
    if rank <= 0:
        return 0
    for bucket in buckets:
        if rank <= bucket:
            return bucket
    raise ValueError(f"rank {rank} is above the slot's largest bucket {buckets[-1]}")
