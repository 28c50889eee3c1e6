"""load_reward: built-in names, module paths, files, and the errors that name the spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from postrl.errors import ConfigError
from postrl.rewards import BUILTIN_REWARDS, load_reward, math_answer, reward_name
from postrl.rewards.countdown import countdown_reward
from postrl.rewards.math_answer import format_reward

USER_REWARDS = """
from dataclasses import dataclass

@dataclass
class Settings:
    bonus: float = 0.5

def length_bonus(prompts, completions, **columns):
    return [Settings().bonus * len(c) for c in completions]

NOT_A_FUNCTION = 3
"""


def test_builtins() -> None:
    assert set(BUILTIN_REWARDS) == {"math_answer", "format", "countdown", "reasoning_gym",
                                    "environment"}
    assert load_reward("math_answer") is math_answer
    assert load_reward("format") is format_reward
    assert load_reward("countdown") is countdown_reward


def test_module_path() -> None:
    assert load_reward("postrl.rewards.math_answer:math_answer") is math_answer


def test_module_path_on_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards_for_test.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    function = load_reward("my_rewards_for_test:length_bonus")
    assert function(["p"], ["abcd"]) == [2.0]


def test_file_path(tmp_path: Path) -> None:
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    function = load_reward(f"{path}:length_bonus")
    assert function(["p", "p"], ["ab", ""]) == [1.0, 0.0]


def test_two_files_with_the_same_name_do_not_collide(tmp_path: Path) -> None:
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "rewards.py").write_text(f"def fn(p, c, **k):\n    return [{value}]\n")
    first = load_reward(f"{tmp_path / 'a' / 'rewards.py'}:fn")
    second = load_reward(f"{tmp_path / 'b' / 'rewards.py'}:fn")
    assert (first([""], [""]), second([""], [""])) == ([1.0], [2.0])


def test_reward_name() -> None:
    assert reward_name("format") == "format"
    assert reward_name("pkg.module:my_reward") == "my_reward"
    assert reward_name("path/to/file.py:other") == "other"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_reward", r"unknown reward 'no_such_reward'.*math_answer"),
        (":function", r"unknown reward ':function'"),
        ("module:", r"unknown reward 'module:'"),
        ("no_such_module_xyz:fn", r"reward 'no_such_module_xyz:fn'.*cannot import module"),
        ("postrl.rewards.math_answer:no_such_fn", r"has no attribute 'no_such_fn'"),
        ("postrl.rewards.math_answer:_MATH_VERIFY_TIMEOUT_S",
         r"'_MATH_VERIFY_TIMEOUT_S' is a int, not a function"),
        ("missing/dir/rewards.py:fn", r"reward 'missing/dir/rewards.py:fn'.*does not exist"),
    ],
)
def test_errors_name_the_spec(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_reward(spec)


def test_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    with pytest.raises(ConfigError, match=r"has no attribute 'missing'"):
        load_reward(f"{path}:missing")
    with pytest.raises(ConfigError, match=r"'NOT_A_FUNCTION' is a int, not a function"):
        load_reward(f"{path}:NOT_A_FUNCTION")


def test_file_that_fails_to_import(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py.* failed") as caught:
        load_reward(f"{path}:fn")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_the_environment_reward_hands_over_the_episodes_rewards_and_needs_them() -> None:
    reward = load_reward("environment")
    assert reward(["p", "q"], ["a", "b"], env_reward=[1.0, 0.25], secret=[3, 4]) == [1.0, 0.25]
    with pytest.raises(ConfigError, match="needs an environment task"):
        reward(["p"], ["a"], answer=["3"])
