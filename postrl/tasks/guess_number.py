"""Guess the number: a multi-turn environment task with feedback.

The model is told the range and guesses; after each wrong guess the environment answers
"Higher." or "Lower." and the model guesses again, for up to ``max_turns`` turns
(``postrl.rollout.episodes``). The episode pays 1.0 when the number is guessed and 0.0 when
the turns or tokens run out, so the reward ``environment`` is also the verifier: a correct
episode is one that found the number. A turn without a number gets a reminder, not a crash.
With ``turn_cost`` every turn that does not find the number pays ``-turn_cost`` (fewer
guesses are better), a reward per turn that ``env_reward_at=turn`` can place where it fell.

Each puzzle is an upper end ``high`` (from ``min_high`` to ``max_high``) and a secret in
1..high; the puzzles are all such pairs, split by a stable hash so no pair is in both splits.
Binary search needs ceil(log2(high + 1)) guesses, so ranges up to 15 can be solved in 4 turns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from postrl.envs.base import Step
from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits
from postrl.tasks.splits import (
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

QUESTION = ("I am thinking of a whole number from 1 to {high}. Guess it! After each guess I "
            "will tell you if my number is higher or lower. Reply with one number only.")
_INTEGER = re.compile(r"-?\d+")


@dataclass
class GuessingGame:
    """One episode: the secret, and the guesses so far."""

    secret: int
    high: int
    turn_cost: float = 0.0
    guesses: list[int] = field(default_factory=list)

    def step(self, response: str) -> Step:
        """Read the first integer of the model's turn and answer it."""
        found = _INTEGER.search(response)
        if found is None:
            return Step(f"Please reply with one number from 1 to {self.high}.",
                        reward=-self.turn_cost)
        guess = int(found.group())
        self.guesses.append(guess)
        if guess == self.secret:
            return Step("Correct!", reward=1.0, done=True)
        return Step("Higher." if guess < self.secret else "Lower.", reward=-self.turn_cost)


class GuessNumberTask(FixedSplits):
    """Guessing-game episodes; columns ``secret`` and ``high``."""

    name = "guess_number"
    default_rewards: tuple[str, ...] = ("environment",)

    def __init__(self, min_high: int = 5, max_high: int = 15, seed: int = 0,
                 test_fraction: float = 0.2, turn_cost: float = 0.0) -> None:
        if not isinstance(turn_cost, int | float) or not 0 <= turn_cost < 1:
            raise ConfigError(f"turn_cost must be a number in [0, 1), got {turn_cost!r}")
        self.turn_cost = float(turn_cost)
        self.min_high = check_int("min_high", min_high, 2)
        self.max_high = check_int("max_high", max_high, 2)
        if self.max_high < self.min_high:
            raise ConfigError(f"max_high ({max_high}) must be >= min_high ({min_high})")
        self.seed = check_int("seed", seed, 0)
        self.test_fraction = check_test_fraction(test_fraction)
        puzzles = [(f"{high}:{secret}", (high, secret))
                   for high in range(self.min_high, self.max_high + 1)
                   for secret in range(1, high + 1)]
        train, test = split_by_hash(puzzles, self.test_fraction)
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(_examples(train, "guess_number/train"), self.seed))
        self._test = tuple(_examples(test, "guess_number/test"))

    def environment(self, example: Example) -> GuessingGame:
        return GuessingGame(secret=int(example.columns["secret"]),
                            high=int(example.columns["high"]), turn_cost=self.turn_cost)


def _examples(puzzles: list[tuple[int, int]], prefix: str) -> list[Example]:
    return [Example(id=f"{prefix}/{i}", question=QUESTION.format(high=high),
                    columns={"secret": secret, "high": high})
            for i, (high, secret) in enumerate(puzzles)]
