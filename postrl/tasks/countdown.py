"""Countdown: reach a target with given numbers, each used once, and + - * / with parentheses.

Targets are reachable by construction: the numbers are combined by a random expression tree,
evaluated exactly with ``fractions.Fraction``, and only positive integer results are kept. The
expression that was built is kept as the ``solution`` column (a witness, never shown to the
model). Problems are split by a stable hash of (sorted numbers, target), so the same puzzle never
appears in both splits. Targets are capped at ``max_target`` (100 by default, as in the usual
Countdown setups). The problem set depends only on the options, not the seed, which only
orders ``train()``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits
from postrl.tasks.splits import (
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

QUESTION_TEMPLATE = (
    "Using the numbers {numbers}, each exactly once, with + - * / and parentheses, "
    "make {target}. Reply with the expression only."
)
ATTEMPTS_PER_PROBLEM = 50  # give up after this many draws per wanted problem (small spaces)


@dataclass(frozen=True)
class Built:
    """An expression built from some numbers: its text and its exact value."""

    text: str
    value: Fraction


@dataclass(frozen=True)
class Puzzle:
    """One countdown problem: numbers in the order shown, the target, and one solution."""

    numbers: tuple[int, ...]
    target: int
    solution: str

    @property
    def key(self) -> str:
        """What makes two puzzles the same, whatever the order the numbers are shown in."""
        return f"{sorted(self.numbers)}={self.target}"


def combine(left: Built, op: str, right: Built) -> Built | None:
    """Apply ``op`` exactly; ``None`` for a division by zero."""
    if op == "/" and right.value == 0:
        return None
    value = {
        "+": lambda: left.value + right.value,
        "-": lambda: left.value - right.value,
        "*": lambda: left.value * right.value,
        "/": lambda: left.value / right.value,
    }[op]()
    return Built(f"({left.text} {op} {right.text})", value)


def random_expression(numbers: Sequence[int], rng: random.Random) -> Built | None:
    """A random binary expression tree that uses every number once (``None`` on x/0)."""
    if len(numbers) == 1:
        return Built(str(numbers[0]), Fraction(numbers[0]))
    split = rng.randint(1, len(numbers) - 1)
    left = random_expression(numbers[:split], rng)
    right = random_expression(numbers[split:], rng)
    if left is None or right is None:
        return None
    return combine(left, rng.choice("+-*/"), right)


def random_puzzle(
    count: int, max_number: int, max_target: int, rng: random.Random
) -> Puzzle | None:
    """Draw numbers in 1..max_number and an expression over them; ``None`` unless the value is
    an integer in 1..max_target."""
    numbers = [rng.randint(1, max_number) for _ in range(count)]
    order = rng.sample(numbers, len(numbers))  # the tree's order differs from the one shown
    built = random_expression(order, rng)
    if built is None or built.value.denominator != 1 or not 0 < built.value <= max_target:
        return None
    return Puzzle(tuple(numbers), int(built.value), _strip_outer(built.text))


def _strip_outer(text: str) -> str:
    """Drop the parentheses around the whole expression, which ``combine`` always adds."""
    return text[1:-1] if text.startswith("(") else text


class CountdownTask(FixedSplits):
    """Countdown puzzles with columns ``numbers`` (list[int]), ``target`` (int), ``solution``."""

    name = "countdown"
    default_rewards: tuple[str, ...] = ("countdown",)

    def __init__(
        self,
        count: int = 3,
        max_number: int = 10,
        seed: int = 0,
        test_fraction: float = 0.1,
        num_problems: int = 2000,
        max_target: int = 100,
    ) -> None:
        self.count = check_int("count", count, 2)
        self.max_number = check_int("max_number", max_number, 1)
        self.seed = check_int("seed", seed, 0)
        self.test_fraction = check_test_fraction(test_fraction)
        self.num_problems = check_int("num_problems", num_problems, 2)
        self.max_target = check_int("max_target", max_target, 1)
        puzzles = self._generate()
        train, test = split_by_hash(((p.key, p) for p in puzzles), self.test_fraction)
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(_examples(train, "countdown/train"), self.seed))
        self._test = tuple(_examples(test, "countdown/test"))


    def _generate(self) -> list[Puzzle]:
        """Up to ``num_problems`` distinct puzzles from a stream fixed by the options."""
        rng = random.Random(f"countdown:{self.count}:{self.max_number}:{self.max_target}")
        puzzles: dict[str, Puzzle] = {}
        for _ in range(self.num_problems * ATTEMPTS_PER_PROBLEM):
            puzzle = random_puzzle(self.count, self.max_number, self.max_target, rng)
            if puzzle is not None and puzzle.key not in puzzles:
                puzzles[puzzle.key] = puzzle
                if len(puzzles) == self.num_problems:
                    break
        if len(puzzles) < 2:
            raise ConfigError(
                f"countdown: count={self.count}, max_number={self.max_number} and "
                f"max_target={self.max_target} admit fewer than 2 distinct puzzles"
            )
        return list(puzzles.values())


def _examples(puzzles: Sequence[Puzzle], prefix: str) -> list[Example]:
    """Examples with ids ``<prefix>/<index>``, numbered before any shuffle."""
    return [
        Example(
            id=f"{prefix}/{index}",
            question=QUESTION_TEMPLATE.format(numbers=list(p.numbers), target=p.target),
            columns={"numbers": list(p.numbers), "target": p.target, "solution": p.solution},
        )
        for index, p in enumerate(puzzles)
    ]
