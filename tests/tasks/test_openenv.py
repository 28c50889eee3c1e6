"""``openenv:MODULE:CLASS`` with a real OpenEnv environment: the echo environment that
OpenEnv's own ``openenv init`` writes, played in this process (``make test-openenv``)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.tasks import load_task

HAS_OPENENV = importlib.util.find_spec("openenv") is not None
needs_openenv = pytest.mark.skipif(not HAS_OPENENV, reason="needs openenv-core "
                                   "(make test-openenv)")
ECHO = "openenv:echo_env.server.echo_env_environment:EchoEnvironment"


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory):
    """The template environment of ``openenv init echo_env``, importable as ``echo_env``."""
    folder = tmp_path_factory.mktemp("openenv")
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env"], cwd=folder,
                   check=True, capture_output=True, timeout=120)
    sys.path.insert(0, str(folder))
    yield ECHO
    sys.path.remove(str(folder))
    for name in [n for n in sys.modules if n == "echo_env" or n.startswith("echo_env.")]:
        del sys.modules[name]


def test_without_openenv_the_task_says_which_extra_to_install():
    if HAS_OPENENV:
        pytest.skip("openenv-core is installed here")
    with pytest.raises(ConfigError, match=r"postrl\[openenv\]"):
        load_task(ECHO)


@needs_openenv
def test_an_environment_whose_start_never_changes_needs_distinct_starts_false(echo_env):
    with pytest.raises(ConfigError, match="distinct_starts=false"):
        load_task(echo_env, size=8)
    task = load_task(echo_env, size=10, test_fraction=0.2, distinct_starts=False)
    assert len(task.train()) == 8 and [e.columns["seed"] for e in task.test()] == [8, 9]
    assert task.test()[0].question == ("echoed_message: Echo Env environment ready!\n"
                                       "message_length: 0")


@needs_openenv
def test_a_turn_is_the_action_and_the_observation_comes_back_as_text(echo_env):
    task = load_task(echo_env, size=4, test_fraction=0.25, distinct_starts=False,
                     observation_fields=["echoed_message"])
    episode = task.environment(task.test()[0])
    step = episode.step("hello")
    assert step.observation == "hello" and not step.done
    assert step.reward == pytest.approx(0.5)  # the template pays 0.1 per character


@pytest.mark.parametrize(("path", "options", "named"), [
    ("echo_env.server.echo_env_environment", {}, "openenv:MODULE:CLASS"),
    ("echo_env.server.echo_env_environment:Nope", {}, "EchoEnvironment"),
    ("no_such_module_here:Env", {}, "no_such_module_here"),
    ("echo_env.server.echo_env_environment:EchoEnvironment", {"action_field": "text"},
     "action_field='text'"),
    ("echo_env.server.echo_env_environment:EchoEnvironment", {"speed": 2}, "speed"),
])
@needs_openenv
def test_what_cannot_be_played_is_refused_by_name(echo_env, path, options, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        load_task(f"openenv:{path}", distinct_starts=False, size=4, **options)


@needs_openenv
def test_distinct_starts_takes_true_or_false_only(echo_env):
    with pytest.raises(ConfigError, match="distinct_starts must be true or false, got 'no'"):
        load_task(echo_env, size=4, distinct_starts="no")


@needs_openenv
def test_postrl_trains_on_an_openenv_environment_unchanged(echo_env, tmp_path):
    from postrl.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = load_config(None, [
        "model=tiny", f"task={echo_env}", "task_options.distinct_starts=false",
        "task_options.size=12", "task_options.observation_fields=[echoed_message]",
        "recipe=dr_grpo", "steps=2", "prompts_per_step=2", "group_size=2", "max_turns=3",
        "max_new_tokens=24", "stop=[e]", f"out={out}", "quiet=true", "lr=1e-3"])
    Trainer(cfg).train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # turns end at an "e": episodes of several turns, each paid by the environment
    assert max(r["episode/turns_mean"] for r in rows) > 1
    assert all(r["reward/mean"] > 0 for r in rows)
