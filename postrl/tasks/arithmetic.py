"""Synthetic arithmetic: "What is 6 + 3? Reply with only the number."

The problem space (every pair of operands with exactly ``digits`` digits, for every chosen
operator) is enumerated, or sampled from a fixed stream when it is large. Each problem goes to
the train or the test split by a stable hash of its text, so no question is in both splits,
whatever the seed, the operators or the size of the space. The seed only orders ``train()``.

This module also holds the split helpers the other tasks share (``stable_fraction``,
``in_test_split``, ``check_test_fraction``, ``seeded_shuffle``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits

T = TypeVar("T")

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
QUESTION_TEMPLATE = "What is {a} {op} {b}? Reply with only the number."


# --- split helpers shared by all tasks -------------------------------------------------------


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


# --- the arithmetic task ----------------------------------------------------------------------


def parse_operators(operators: str | Sequence[str]) -> tuple[str, ...]:
    """Accept ``"+-*"``, ``"+,-"`` or ``["+", "-"]``; return the distinct operators in order."""
    if isinstance(operators, str):
        symbols = [s for s in operators.replace(",", "").replace(" ", "")]
    else:
        symbols = list(operators)
    unknown = [s for s in symbols if s not in OPERATORS]
    if not symbols or unknown:
        raise ConfigError(f"operators must be chosen from '+-*', got {operators!r}")
    return tuple(dict.fromkeys(symbols))


def operand_range(digits: int) -> range:
    """Integers with exactly ``digits`` digits; one digit includes 0 (0..9)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return range(low, 10**digits)


class ArithmeticTask(FixedSplits):
    """Two-operand integer arithmetic with exact integer answers (negative ones for ``-``)."""

    name = "arithmetic"
    default_rewards: tuple[str, ...] = ("math_answer",)

    def __init__(
        self,
        operators: str | Sequence[str] = "+",
        digits: int = 1,
        seed: int = 0,
        test_fraction: float = 0.1,
        max_problems: int = 50_000,
    ) -> None:
        self.operators = parse_operators(operators)
        self.digits = check_int("digits", digits, 1)
        self.seed = check_int("seed", seed, 0)
        self.test_fraction = check_test_fraction(test_fraction)
        self.max_problems = check_int("max_problems", max_problems, 1)
        keyed = ((question, (question, answer)) for question, answer in self._space())
        train, test = split_by_hash(keyed, self.test_fraction)
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(_examples(train, "arithmetic/train"), self.seed))
        self._test = tuple(_examples(test, "arithmetic/test"))

    def _space(self) -> Iterable[tuple[str, int]]:
        """All (question, answer) pairs, or a fixed sample of them when there are too many."""
        operands = operand_range(self.digits)
        size = len(self.operators) * len(operands) ** 2
        if size <= self.max_problems:
            triples: Iterable[tuple[str, int, int]] = (
                (op, a, b) for op in self.operators for a in operands for b in operands
            )
        else:
            triples = self._sample_triples(operands)
        for op, a, b in triples:
            yield QUESTION_TEMPLATE.format(a=a, op=op, b=b), OPERATORS[op](a, b)

    def _sample_triples(self, operands: range) -> list[tuple[str, int, int]]:
        """``max_problems`` distinct problems from a stream fixed by the options, not the seed."""
        rng = random.Random(f"arithmetic:{''.join(self.operators)}:{self.digits}")
        chosen: dict[tuple[str, int, int], None] = {}
        while len(chosen) < self.max_problems:
            chosen[(rng.choice(self.operators), rng.choice(operands), rng.choice(operands))] = None
        return list(chosen)


def _examples(problems: Iterable[tuple[str, int]], prefix: str) -> list[Example]:
    """Examples with ids ``<prefix>/<index>``, numbered before any shuffle (seed-independent)."""
    return [
        Example(id=f"{prefix}/{index}", question=question, columns={"answer": str(answer)})
        for index, (question, answer) in enumerate(problems)
    ]
