"""Reward functions by name: the built-ins, ``module.path:function``, ``file.py:function`` or
``reward_model:PATH`` (a learned reward model, postrl.rewards.reward_model)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from postrl.config_paths import is_file_spec
from postrl.errors import ConfigError
from postrl.rewards.base import RewardFunction
from postrl.rewards.countdown import countdown_reward
from postrl.rewards.environment import environment_reward
from postrl.rewards.math_answer import format_reward, math_answer
from postrl.rewards.reasoning_gym import reasoning_gym_reward
from postrl.rewards.reward_model import PREFIX as REWARD_MODEL
from postrl.rewards.reward_model import load_reward_model, reward_model_name

BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "math_answer": math_answer,
    "format": format_reward,
    "countdown": countdown_reward,
    "reasoning_gym": reasoning_gym_reward,  # the task reasoning_gym:NAME's verifier
    "environment": environment_reward,  # a multi-turn episode's environment reward
}


def reward_name(spec: str) -> str:
    """The short name a reward is logged under: the built-in name, the function's name or a
    reward model's directory name."""
    if spec in BUILTIN_REWARDS:
        return spec
    kind, separator, location = spec.partition(":")
    if separator and kind == REWARD_MODEL:
        return reward_model_name(location)
    return spec.rsplit(":", 1)[-1]


def _load_file(location: str, spec: str) -> ModuleType:
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"reward {spec!r}: file {str(path)!r} does not exist")
    # A name unique to the path, so two files called rewards.py do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_spec = importlib.util.spec_from_file_location(f"postrl_user_reward_{digest}", path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"reward {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as importlib's recipe does: dataclasses, pickle
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # a script that exits when imported, too
        del sys.modules[module_spec.name]
        raise ConfigError(
            f"reward {spec!r}: importing {str(path)!r} failed: {type(error).__name__}: {error}"
        ) from error
    return module


def _load_module(location: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(location)
    except (Exception, SystemExit) as error:
        raise ConfigError(
            f"reward {spec!r}: cannot import module {location!r}: {type(error).__name__}: {error}"
        ) from error


def load_reward(spec: str) -> RewardFunction:
    """A built-in name (``math_answer``, ``format``, ``countdown``, ``reasoning_gym``),
    ``module.path:function``, ``path/to/file.py:function`` or ``reward_model:PATH``;
    ConfigError naming ``spec`` if it cannot be loaded."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    kind, separator, location = spec.partition(":")
    if separator and kind == REWARD_MODEL:
        if not location:
            raise ConfigError(f"reward {spec!r}: expected {REWARD_MODEL}:PATH, a local directory")
        return load_reward_model(spec, location)
    location, separator, attribute = spec.rpartition(":")
    if not separator or not location or not attribute:
        raise ConfigError(
            f"unknown reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)}, "
            "'module.path:function', 'path/to/file.py:function' or 'reward_model:PATH'"
        )
    if is_file_spec(location):
        module = _load_file(location, spec)
    else:
        module = _load_module(location, spec)
    if not hasattr(module, attribute):
        raise ConfigError(f"reward {spec!r}: {location!r} has no attribute {attribute!r}")
    function = getattr(module, attribute)
    if not callable(function):
        raise ConfigError(
            f"reward {spec!r}: {attribute!r} is a {type(function).__name__}, not a function"
        )
    return function
