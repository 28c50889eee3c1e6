"""Consecutive size-bounded buckets: how weights travel in pieces (the Ray weight push, the
vLLM engine's loads) without a whole copy of the model in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def consecutive_buckets(items: Iterable[T], nbytes: Callable[[T], int],
                        limit: int) -> Iterator[list[T]]:
    """``items`` in order, in consecutive buckets of at most ``limit`` bytes; an item larger
    than ``limit`` goes alone. Lazy: each item is pulled only as its bucket fills."""
    bucket: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket
