"""Prompts in, scored groups out: the prompt sampler and DAPO's dynamic sampling (§6)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from postrl.errors import DataError
from postrl.rollout import Rollouts
from postrl.tasks import Example


class PromptSampler:
    """Endless, seeded passes over the training examples, reshuffled every epoch."""

    def __init__(self, examples: Sequence[Example], seed: int) -> None:
        if not examples:
            raise ValueError("the task has no training examples")
        self.examples = list(examples)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        return order

    def restore(self, epoch: int, position: int) -> None:
        """Continue from a checkpoint: the same epoch's order, at the same position."""
        self.epoch, self.position = epoch, position
        self._order = self._shuffled()

    def take(self, count: int) -> list[Example]:
        batch = []
        for _ in range(count):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled()
            batch.append(self.examples[self._order[self.position]])
            self.position += 1
        return batch


class PromptTokens:
    """Each example's prompt tokenized once; a DataError naming the example when the prompt
    and ``max_new_tokens`` do not fit the model's context."""

    def __init__(self, tokenizer, model, max_new_tokens: int) -> None:
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.cache: dict[str, list[int]] = {}

    def __call__(self, example_id: str, prompt: str) -> list[int]:
        if example_id not in self.cache:
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
            if self.context and len(ids) + self.max_new_tokens > self.context:
                raise DataError(f"{example_id}: the prompt has {len(ids)} tokens; with "
                                f"max_new_tokens={self.max_new_tokens} it exceeds the "
                                f"model's context of {self.context} tokens")
            self.cache[example_id] = ids
        return self.cache[example_id]


@dataclass
class Group:
    """One prompt's G responses with their rewards, as generated in one round."""

    example: Example
    prompt_text: str
    rollouts: Rollouts  # the G rows of this prompt only
    rewards: list[float]
    per_function: dict[str, list[float | None]]
    correct: list[bool]
    # env_reward_at=turn: [G, T] the weighted environment rewards at the turns' last tokens
    # (part of ``rewards``, which the advantage of every other token sees at the end)
    turn_rewards: Tensor | None = None

    @property
    def zero_variance(self) -> bool:
        return max(self.rewards) == min(self.rewards)

    def useful(self, by: str) -> bool:
        """Whether dynamic sampling keeps this group: ``by="correctness"``, some but not all
        of its responses are correct (DAPO §3.2: 0 < #correct < G; shaping such as the
        overlong penalty cannot make an all-wrong group useful); ``"reward"``, its rewards
        are not all equal."""
        if by == "correctness":
            return 0 < sum(self.correct) < len(self.correct)
        return not self.zero_variance

    @property
    def tokens(self) -> int:
        return self.rollouts.num_tokens


@dataclass
class Collected:
    groups: list[Group]  # exactly the groups that reach the loss
    generated: list[Group]  # every group generated this step, in order
    rounds: int

    @property
    def tokens_generated(self) -> int:
        return sum(g.tokens for g in self.generated)

    @property
    def tokens_wasted(self) -> int:
        kept = {id(g) for g in self.groups}
        return sum(g.tokens for g in self.generated if id(g) not in kept)


def collect(
    generate_round: Callable[[int], list[Group]],
    prompts: int,
    dynamic_sampling: bool,
    max_rounds: int,
    useful_by: str = "correctness",
) -> Collected:
    """One round of ``prompts`` groups, or with dynamic sampling (DAPO §3.2) rounds until
    ``prompts`` groups are useful (:meth:`Group.useful` ``by`` ``useful_by``; at most
    ``max_rounds``); exactly ``prompts`` groups are kept, the surplus is discarded (and
    counted as wasted), as verl's DAPO does."""
    generated: list[Group] = []
    useful: list[Group] = []
    rounds = 0
    while rounds < (max_rounds if dynamic_sampling else 1):
        batch = generate_round(rounds)
        rounds += 1
        generated += batch
        useful += [g for g in batch if not dynamic_sampling or g.useful(useful_by)]
        if len(useful) >= prompts:
            break
    return Collected(groups=useful[:prompts], generated=generated, rounds=rounds)
