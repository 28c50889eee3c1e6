"""What every task shares: which split a problem falls in (a stable hash of its text, so no
question is in both splits, whatever the seed), the seeded order of the train split, and the
checks of the options most tasks take (``seed``, ``test_fraction``, sizes, flags)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import TypeVar

from postrl.errors import ConfigError

T = TypeVar("T")


def stable_fraction(key: str) -> float:
    """Map ``key`` to [0, 1) with SHA-256: the same on every run, unlike ``hash()``."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def in_test_split(key: str, test_fraction: float) -> bool:
    """Whether the problem named by ``key`` is held out; a fixed property of the problem."""
    return stable_fraction(key) < test_fraction


def check_test_fraction(test_fraction: float) -> float:
    """Validate the ``test_fraction`` option (strictly between 0 and 1)."""
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise ConfigError(f"test_fraction must be a number, got {test_fraction!r}")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    return float(test_fraction)


def check_int(name: str, value: object, minimum: int) -> int:
    """Validate an integer option ``name`` that must be at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Validate a true-or-false option ``name`` (YAML's true/false, not 0, 1 or "no")."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def seeded_shuffle(items: Iterable[T], seed: int) -> list[T]:
    """A copy of ``items`` in an order fixed by ``seed``."""
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def split_by_hash(keyed: Iterable[tuple[str, T]], test_fraction: float) -> tuple[list[T], list[T]]:
    """Split ``(key, item)`` pairs into (train, test); test is ordered by the key's hash."""
    train, test = [], []
    for key, item in keyed:
        (test if in_test_split(key, test_fraction) else train).append((key, item))
    test.sort(key=lambda pair: (stable_fraction(pair[0]), pair[0]))
    return [item for _, item in train], [item for _, item in test]


def check_both_splits(name: str, train: Sequence[object], test: Sequence[object]) -> None:
    """Raise a ConfigError when a split came out empty (the problem space is too small)."""
    if not train or not test:
        raise ConfigError(
            f"{name}: test_fraction leaves {len(train)} train and {len(test)} test problems; "
            "choose a test_fraction (or a larger problem space) that leaves both non-empty"
        )
