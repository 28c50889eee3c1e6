"""The Scorer: run every reward function once on a batch and combine them with weights."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Real
from typing import Any

from postrl.errors import ConfigError, DataError, RewardError
from postrl.rewards.base import RewardFunction
from postrl.rewards.registry import load_reward, reward_name


@dataclass
class ScoredRewards:
    """``total[i]`` is the weighted sum over the functions that apply to sample ``i``;
    ``per_function[name][i]`` is what each function returned (None: not applicable)."""

    total: list[float]
    per_function: dict[str, list[float | None]]
    errors: int = 0  # values replaced by 0 (on_error="zero")


@dataclass(frozen=True)
class _WeightedReward:
    name: str
    function: RewardFunction
    weight: float


def _resolve(spec: str | RewardFunction, weight: float) -> _WeightedReward:
    if not isinstance(weight, Real) or not math.isfinite(weight):
        raise ConfigError(f"reward {spec!r}: weight must be a finite number, got {weight!r}")
    if isinstance(spec, str):
        return _WeightedReward(reward_name(spec), load_reward(spec), float(weight))
    if callable(spec):
        return _WeightedReward(getattr(spec, "__name__", repr(spec)), spec, float(weight))
    raise ConfigError(f"reward {spec!r} is neither a name, a 'module:function' spec nor callable")


def _checked_value(name: str, index: int, value: Any) -> float | None:
    """``value`` as a float (None stays None); RewardError naming the function and sample."""
    if value is None:
        return None
    if not isinstance(value, Real):
        raise RewardError(
            f"reward function {name!r} returned {value!r} ({type(value).__name__}) for sample "
            f"{index}; expected a float or None"
        )
    if not math.isfinite(value):
        raise RewardError(f"reward function {name!r} returned {value!r} for sample {index}")
    return float(value)


@contextmanager
def time_limit(seconds: float | None, what: str):
    """Raise RewardError when the block runs longer than ``seconds`` (SIGALRM: only in the
    main thread of the main interpreter; elsewhere the block runs unbounded)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardError(f"{what} took longer than {seconds:g} s (reward_timeout_s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Scorer:
    """Weighted reward functions, given as ``(name_or_spec, weight)`` pairs (TRL's
    ``reward_funcs`` and ``reward_weights``); a spec may also be a callable."""

    def __init__(self, specs: Sequence[tuple[str | RewardFunction, float]],
                 on_error: str = "raise", timeout_s: float | None = None) -> None:
        """``on_error="zero"`` scores a failing function's values 0 and counts them instead of
        raising; ``timeout_s`` bounds each function's call on a batch (main thread only)."""
        if on_error not in ("raise", "zero"):
            raise ConfigError(f"reward_errors must be raise or zero, got {on_error!r}")
        self.on_error = on_error
        self.timeout_s = timeout_s
        self._bad_values = 0
        if not specs:
            raise ConfigError("at least one reward function is needed")
        self.rewards = [_resolve(spec, weight) for spec, weight in specs]
        names = [reward.name for reward in self.rewards]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"reward functions with the same name: {duplicates}; rename one")

    def place(self, device: str) -> Scorer:
        """Put the reward functions that run a model (a ``device`` attribute: learned reward
        models) on the trainer's ``device``."""
        for reward in self.rewards:
            if hasattr(reward.function, "device"):
                reward.function.device = device
        return self

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self.rewards]

    def _call(
        self,
        reward: _WeightedReward,
        prompts: list[str],
        completions: list[Any],
        columns: dict[str, list[Any]],
    ) -> list[float | None]:
        try:
            with time_limit(self.timeout_s, f"reward function {reward.name!r}"):
                values = reward.function(prompts, completions, **columns)
        except RewardError:
            raise
        except SystemExit as exit_:  # a script's sys.exit() must not end the run in silence
            raise RewardError(
                f"reward function {reward.name!r} called sys.exit({exit_.code!r}); a reward "
                "function must return its values"
            ) from exit_
        except Exception as error:
            raise RewardError(
                f"reward function {reward.name!r} raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(values, (list, tuple)):
            raise RewardError(
                f"reward function {reward.name!r} returned a {type(values).__name__}, "
                "expected a list with one value per completion"
            )
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {reward.name!r} returned {len(values)} values for "
                f"{len(completions)} completions"
            )
        return [self._value(reward.name, i, value) for i, value in enumerate(values)]

    def _value(self, name: str, index: int, value: Any) -> float | None:
        """A checked value; with on_error="zero" a bad one becomes 0 and is counted."""
        try:
            return _checked_value(name, index, value)
        except RewardError:
            if self.on_error == "raise":
                raise
            self._bad_values += 1
            return 0.0

    def score(
        self, prompts: list[str], completions: list[Any], columns: dict[str, list[Any]]
    ) -> ScoredRewards:
        """Call each function once on the whole batch and sum the rewards with their weights."""
        if len(prompts) != len(completions):
            raise DataError(f"{len(prompts)} prompts but {len(completions)} completions")
        for column, values in columns.items():
            if len(values) != len(completions):
                raise DataError(
                    f"column {column!r} has {len(values)} values for {len(completions)} samples"
                )
        per_function, errors = {}, 0
        self._bad_values = 0
        for reward in self.rewards:
            try:
                per_function[reward.name] = self._call(reward, prompts, completions, columns)
            except RewardError:
                if self.on_error == "raise":
                    raise
                per_function[reward.name] = [0.0] * len(completions)
                errors += len(completions)
        errors += self._bad_values
        return ScoredRewards(self._totals(per_function, len(completions)), per_function, errors)

    def _totals(self, per_function: dict[str, list[float | None]], size: int) -> list[float]:
        totals: list[float] = []
        for index in range(size):
            applicable = [
                (reward.weight, per_function[reward.name][index])
                for reward in self.rewards
                if per_function[reward.name][index] is not None
            ]
            if not applicable:
                raise RewardError(f"no reward function applies to sample {index} (all None)")
            totals.append(sum(weight * value for weight, value in applicable))
        return totals
