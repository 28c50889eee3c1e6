"""Synthetic arithmetic: "What is 6 + 3? Reply with only the number."

The problem space (every pair of operands with exactly ``digits`` digits, for every chosen
operator) is enumerated, or sampled from a fixed stream when it is large. Each problem goes to
the train or the test split by a stable hash of its text, so no question is in both splits,
whatever the seed, the operators or the size of the space. The seed only orders ``train()``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits
from postrl.tasks.splits import (
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
QUESTION_TEMPLATE = "What is {a} {op} {b}? Reply with only the number."


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
