"""The ``environment`` reward: what a multi-turn episode's environment paid (``postrl.envs``).

The trainer puts each episode's summed environment reward in the ``env_reward`` column; this
function hands it to the Scorer, so that it is weighted and combined like any other reward.
Outside an environment task there is no such column, and using it is a configuration error.
"""

from __future__ import annotations

from typing import Any

from postrl.errors import ConfigError


def environment_reward(prompts: list[str], completions: list[str],
                       env_reward: list[float] | None = None, **_: Any) -> list[float]:
    """Each episode's environment reward, as the environment summed it over its steps."""
    if env_reward is None:
        raise ConfigError("reward 'environment' needs an environment task (one whose examples "
                          "are played as multi-turn episodes); this task has none")
    return [float(r) for r in env_reward]
