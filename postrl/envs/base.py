"""The environment protocol: the model takes a turn, the environment answers.

An episode starts from a task's example (its question is the first user turn). After each of
the model's turns the environment returns a :class:`Step`: the next observation (a message
the model reads as its next user or tool turn), a reward, and whether the episode is over.
The episode's reward is the sum of its steps' rewards; it reaches the reward functions as the
``env_reward`` column (the built-in reward ``environment`` reads it), so it combines with
verifiers by weight like any other reward.

Environment text is appended to the episode as tokens that are context only: the model is
never trained on them, and they count in no normaliser (``postrl.rollout.episodes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

ROLES = ("user", "tool")


@dataclass(frozen=True)
class Step:
    """What the environment says after one model turn. ``observation`` is ignored when
    ``done``; ``role`` is the chat role it is shown with (``user`` or ``tool``)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    role: str = "user"
    tool_calls: int = 0  # tools this turn called, for the metrics
    tool_errors: int = 0  # of which failed (a failure is an observation, never a crash)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Step.role must be one of {ROLES}, got {self.role!r}")


class Environment(Protocol):
    """One episode's state. ``step`` receives the text of the model's latest turn."""

    def step(self, response: str) -> Step: ...


class EnvironmentTask(Protocol):
    """What makes a task (``postrl.tasks.base.Task``) an environment task: its examples are
    played as episodes, each started by ``environment(example)`` (a ``postrl.tasks.Example``;
    tasks build environments, so this package imports no task)."""

    def environment(self, example: Any) -> Environment: ...


def is_environment_task(task: Any) -> bool:
    """Whether ``task`` plays its examples as multi-turn episodes."""
    return callable(getattr(task, "environment", None))
