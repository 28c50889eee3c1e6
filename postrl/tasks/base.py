"""What a task hands to the rest of the pipeline: examples with a question and its columns."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    """One prompt of a task.

    ``id`` is stable and names the sample in errors and logs (``"arithmetic/train/17"``,
    ``"data/train.jsonl:12"``). ``question`` is the raw user text, before any chat template.
    ``columns`` are passed to every reward function as keyword arguments (TRL's convention):
    math tasks put the gold ``answer`` there, countdown its ``numbers`` and ``target``.
    """

    id: str
    question: str
    columns: dict[str, Any] = field(default_factory=dict)


class FixedSplits:
    """Train and held-out examples computed once at construction (``_train``, ``_test``)."""

    _train: tuple[Example, ...]
    _test: tuple[Example, ...]

    def train(self) -> Sequence[Example]:
        """Training examples, shuffled by the task's ``seed``."""
        return self._train

    def test(self) -> Sequence[Example]:
        """Held-out examples, in a fixed order that does not depend on ``seed``."""
        return self._test


class Task(Protocol):
    """A source of training and held-out examples with the rewards that verify them."""

    name: str
    default_rewards: tuple[str, ...]  # names of built-in reward functions (postrl.rewards)

    def train(self) -> Sequence[Example]: ...

    def test(self) -> Sequence[Example]: ...


def constructor_options(cls: type, own: Sequence[str]) -> list[str]:
    """The parameters of ``cls``'s constructor a user may set as task options: named ones
    that are not ``own`` (the task's options of the same name win)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.name not in own
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
