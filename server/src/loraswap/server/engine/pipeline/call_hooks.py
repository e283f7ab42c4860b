"""Work done around each call of one object's method, for the length of a block: the runner's marks around the
pipeline's encode_prompt, and the step boundaries tests and benchmarks count at (a scheduler's step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def around_calls(
    owner: object, name: str, *, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None
) -> Iterator[None]:
    """`before()` and `after()` around each call of `owner.<name>` while inside (`after` also when the call raises).

    The wrapper is an instance attribute that shadows the class's method and is removed again at the end (an
    instance attribute of that name already there is put back), so nothing outlives the block.
    """
    method = getattr(owner, name)
    shadowed = vars(owner).get(name)

    def wrapped(*args, **kwargs):
        if before is not None:
            before()
        try:
            return method(*args, **kwargs)
        finally:
            if after is not None:
                after()

    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        if shadowed is None:
            delattr(owner, name)
        else:
            setattr(owner, name, shadowed)
