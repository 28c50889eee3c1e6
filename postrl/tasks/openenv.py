"""``openenv:MODULE:CLASS``: an environment written for OpenEnv (``openenv-core``; ``pip install
'postrl[openenv]'``), played as postrl episodes, unchanged and in this process.

CLASS is a subclass of OpenEnv's ``Environment``: ``reset()`` returns an ``Observation`` and
``step(action)`` the next one, with its ``reward`` and ``done``; actions and observations are
the environment's own pydantic classes. postrl drives the class directly, as OpenEnv's server
does behind its HTTP and WebSocket routes: no container, no port, no network. MODULE must be
importable (an installed package, or a folder on ``PYTHONPATH``).

**Examples.** Episode ``s`` is played by a fresh instance from ``reset(seed=s)``, for ``s`` in
0..size-1 (``reset()`` where it takes no seed), and its question is that first observation as
text. Seeds that start the same (the same observation) are kept once, and the split is by a
stable hash of the start, so no start is in both splits; an environment whose start never
changes needs ``distinct_starts=false``, which keeps every seed and splits by seed. The
class's constructor parameters are task options too.

**Turns.** The model's turn is the action: an instance of the class that ``step``'s type hint
names, with the turn's text in its one text field (``action_field`` names it when there are
several). What the model reads next is the observation's own fields (not ``done``, ``reward``
or ``metadata``): one field's value as it is, several as ``name: value`` lines
(``observation_fields`` picks and orders them).

**Rewards.** A step's reward is the observation's ``reward`` (None is 0.0), so the reward
``environment`` (their sum) is the environment's return, and an episode is correct when it is
1.0; the episode ends when the observation is ``done``. An environment that raises inside
``step`` ends the episode with reward 0.0 and the error as its observation (logged as a
warning), never a crash. Randomness inside the environment is its own: only ``reset``'s seed
is postrl's.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import typing
from typing import Any

from postrl.envs.base import Step
from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits, constructor_options
from postrl.tasks.splits import (
    check_bool,
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

LOG = logging.getLogger(__name__)
# postrl's options; the rest are the environment's constructor parameters
OWN_OPTIONS = ("seed", "test_fraction", "size", "distinct_starts", "action_field",
               "observation_fields")
BASE_FIELDS = ("done", "reward", "metadata")  # every OpenEnv Observation has them


def environment_class(path: str) -> type:
    """CLASS of ``MODULE:CLASS``, checked to be an OpenEnv ``Environment``; ConfigError
    naming what is missing."""
    module_name, colon, name = path.partition(":")
    if not colon or not module_name or not name:
        raise ConfigError(f"task openenv:{path}: name the environment as openenv:MODULE:CLASS, "
                          "e.g. openenv:echo_env.server.echo_env_environment:EchoEnvironment")
    try:
        base = importlib.import_module("openenv.core.env_server.interfaces").Environment
    except ImportError as error:
        raise ConfigError(f"task openenv:{path} needs the optional extra: "
                          "pip install 'postrl[openenv]'") from error
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"task openenv:{path}: cannot import {module_name!r} ({error}); "
                          "install its package or put its folder on PYTHONPATH") from error
    cls = getattr(module, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isclass(v) and issubclass(v, base) and v is not base)
        raise ConfigError(f"task openenv:{path}: {module_name} has no OpenEnv Environment "
                          f"named {name!r} (it has: {', '.join(found) or 'none'})")
    return cls


def _action_class(cls: type, path: str) -> type:
    hints = typing.get_type_hints(cls.step)
    action = hints.get("action")
    if not inspect.isclass(action):
        raise ConfigError(f"task openenv:{path}: {cls.__name__}.step has no action class in "
                          "its type hints (step(self, action: MyAction)), so postrl cannot "
                          "build the action from the model's text")
    return action


def _text_field(action: type, chosen: str | None, path: str) -> str:
    """The action's field that gets the model's text: ``chosen``, or its one str field."""
    fields = {n: f for n, f in action.model_fields.items() if n != "metadata"}
    texts = [n for n, f in fields.items() if f.annotation is str]
    if chosen is not None:
        if chosen not in fields:
            raise ConfigError(f"task openenv:{path}: action_field={chosen!r} is not a field of "
                              f"{action.__name__} (its fields: {', '.join(fields)})")
        return chosen
    if len(texts) != 1:
        raise ConfigError(f"task openenv:{path}: {action.__name__} has {len(texts)} text "
                          f"fields ({', '.join(texts) or 'none'}); name the one that gets the "
                          "model's turn with task_options.action_field")
    return texts[0]


def observation_text(observation: Any, fields: tuple[str, ...] | None = None) -> str:
    """An observation as the model reads it: its own fields (``fields``, or all but
    ``done``, ``reward`` and ``metadata``), one as its value, several as ``name: value``."""
    values = observation.model_dump()
    names = fields or tuple(n for n in values if n not in BASE_FIELDS)
    if len(names) == 1:
        return str(values[names[0]])
    return "\n".join(f"{name}: {values[name]}" for name in names)


class OpenEnvTask(FixedSplits):
    """An OpenEnv ``Environment`` class's episodes (see the module's docstring)."""

    default_rewards: tuple[str, ...] = ("environment",)

    def __init__(self, path: str, seed: int = 0, test_fraction: float = 0.1, size: int = 200,
                 distinct_starts: bool = True, action_field: str | None = None,
                 observation_fields: list[str] | None = None, **options: Any) -> None:
        self.name = f"openenv:{path}"
        self.cls = environment_class(path)
        unknown = sorted(set(options) - set(constructor_options(self.cls, OWN_OPTIONS)))
        if unknown:  # load_task checks too; a direct caller gets the same error
            raise ConfigError(f"task {self.name}: unknown option(s) {', '.join(unknown)}")
        self.options = options
        self.seed = check_int("seed", seed, 0)
        size = check_int("size", size, 2)
        distinct_starts = check_bool("distinct_starts", distinct_starts)
        self.action = _action_class(self.cls, path)
        self.action_field = _text_field(self.action, action_field, path)
        self.observation_fields = tuple(observation_fields) if observation_fields else None
        starts = [(s, self._start(s)[1]) for s in range(size)]
        if distinct_starts:
            kept: dict[str, int] = {}
            for s, text in starts:
                kept.setdefault(text, s)
            if len(kept) < 2:
                raise ConfigError(f"task {self.name}: all {size} seeds start the same (its "
                                  "reset takes no seed, or ignores it): nothing to hold out "
                                  "by start; set task_options.distinct_starts=false to keep "
                                  "every seed and split by seed")
            train, test = split_by_hash(((text, (s, text)) for text, s in kept.items()),
                                        check_test_fraction(test_fraction))
        else:  # every start alike: the last seeds are held out
            cut = max(1, round(size * check_test_fraction(test_fraction)))
            train, test = starts[:-cut], starts[-cut:]
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(self._examples(train, "train"), self.seed))
        self._test = tuple(self._examples(test, "test"))

    @classmethod
    def accepted_options(cls, path: str) -> list[str]:
        return [*OWN_OPTIONS, *constructor_options(environment_class(path), OWN_OPTIONS)]

    def _start(self, seed: int) -> tuple[Any, str]:
        """A fresh instance after its reset with ``seed``, and its first observation's text."""
        env = self.cls(**self.options)
        takes_seed = "seed" in inspect.signature(env.reset).parameters
        first = env.reset(seed=seed) if takes_seed else env.reset()
        return env, observation_text(first, self.observation_fields)

    def _examples(self, starts: list[tuple[int, str]], split: str) -> list[Example]:
        return [Example(id=f"{self.name}/{split}/{s}", question=text, columns={"seed": s})
                for s, text in starts]

    def environment(self, example: Example) -> OpenEnvEpisode:
        env, _ = self._start(int(example.columns["seed"]))
        return OpenEnvEpisode(env, self)


class OpenEnvEpisode:
    """One episode of an OpenEnv environment: the model's turn in, a postrl Step out."""

    def __init__(self, env: Any, task: OpenEnvTask) -> None:
        self.env, self.task = env, task

    def step(self, response: str) -> Step:
        task = self.task
        try:
            observation = self.env.step(task.action(**{task.action_field: response}))
        except Exception as error:  # the environment's failure ends the episode, not the run
            LOG.warning("%s: step raised %s: %s", task.name, type(error).__name__, error)
            return Step(f"{type(error).__name__}: {error}", reward=0.0, done=True)
        reward = float(observation.reward) if observation.reward is not None else 0.0
        return Step(observation_text(observation, task.observation_fields), reward=reward,
                    done=bool(observation.done))
