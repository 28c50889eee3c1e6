"""``textarena:NAME``: TextArena's single-player games played as episodes, on the real library."""

import random
import sys

import numpy as np
import pytest

from postrl.envs import Step, is_environment_task
from postrl.errors import ConfigError
from postrl.tasks import load_task
from postrl.tasks.registry import TASK_FORMS

ta = pytest.importorskip("textarena")

SPEC = "textarena:GuessTheNumber-v0"


@pytest.fixture(scope="module")
def task():
    return load_task(SPEC)


def library_game(game: str, seed: int, actions=()):
    """TextArena played directly, as its own docs do: the messages player 0 gets after reset
    and after each action (without the echo of the action), and the final rewards."""
    env = ta.make(game)
    state = random.getstate()
    env.reset(num_players=1, seed=seed)
    base = env
    while isinstance(base, ta.Wrapper):
        base = base.env
    seen, done = [], False

    def messages():
        return [m.strip() for _, m, kind in base.get_observation()[1]
                if kind != ta.ObservationType.PLAYER_ACTION and m.strip()]

    seen.append(messages())
    for action in actions:
        done, _ = env.step(action)
        seen.append(messages())
        if done:
            break
    rewards = env.close()[0] if done else None
    random.setstate(state)
    return seen, rewards, base.state.game_state


def secret_of(example) -> int:
    return library_game("GuessTheNumber-v0", example.columns["ta_seed"])[2]["game_number"]


def test_the_spec_is_registered_and_the_task_plays_episodes(task):
    assert any(form.startswith("textarena:NAME") for form in TASK_FORMS)
    assert is_environment_task(task) and task.default_rewards == ("environment",)
    assert task.name == SPEC


def test_the_examples_and_split_are_deterministic_and_disjoint(task):
    again = load_task(SPEC)
    assert [(e.id, e.question, e.columns) for e in task.train()] == \
        [(e.id, e.question, e.columns) for e in again.train()]
    assert [e.id for e in task.test()] == [e.id for e in again.test()]
    # GuessTheNumber-v0 deals 20 secrets: each is kept once, in one split only
    train_secrets = {secret_of(e) for e in task.train()}
    test_secrets = {secret_of(e) for e in task.test()}
    assert len(task.train()) == len(train_secrets) and len(task.test()) == len(test_secrets)
    assert train_secrets.isdisjoint(test_secrets)
    assert train_secrets | test_secrets == set(range(1, 21))
    # seed orders train() only: the same games, the same held-out list
    other = load_task(SPEC, seed=1)
    assert [e.id for e in other.train()] != [e.id for e in task.train()]
    assert sorted(e.id for e in other.train()) == sorted(e.id for e in task.train())
    assert [e.id for e in other.test()] == [e.id for e in task.test()]


def test_the_question_is_the_games_first_observation(task):
    for example in [*task.train()[:3], *task.test()[:3]]:
        seen, _, _ = library_game("GuessTheNumber-v0", example.columns["ta_seed"])
        assert example.question == "\n".join(seen[0])
        assert "You are playing Guess The Number" in example.question


def test_binary_search_wins_with_reward_one_and_the_librarys_observations(task):
    for example in [*task.test(), *task.train()[:5]]:
        env = task.environment(example)
        low, high, actions, step = 1, 20, [], None
        for _ in range(5):  # ceil(log2(20)) guesses always suffice
            guess = (low + high) // 2
            actions.append(f"My guess is [{guess}].")
            step = env.step(actions[-1])
            assert isinstance(step, Step) and step.role == "user"
            if step.done:
                break
            assert step.reward == 0.0
            if step.observation == "The target number is higher.":
                low = guess + 1
            else:
                assert step.observation == "The target number is lower."
                high = guess - 1
        assert step.done and step.reward == 1.0, example.id
        assert guess == secret_of(example)
        _, rewards, _ = library_game("GuessTheNumber-v0", example.columns["ta_seed"], actions)
        assert rewards == {0: 1}  # the library's own score of the same play


def test_observations_are_the_librarys_messages_turn_by_turn(task):
    example = task.test()[0]
    actions = ["[1]", "[20]", "[10]", "[7]", "[13]"]
    seen, rewards, _ = library_game("GuessTheNumber-v0", example.columns["ta_seed"], actions)
    env = task.environment(example)
    for action, messages in zip(actions, seen[1:], strict=False):
        step = env.step(action)
        if step.done:
            assert rewards is not None and step.reward == float(rewards[0])
            break
        assert step.observation == "\n".join(messages)


def test_a_garbage_response_is_the_games_invalid_move_then_its_partial_credit(task):
    example = next(e for e in task.test() if secret_of(e) != 10)
    env = task.environment(example)
    assert env.step("[10]").observation.startswith("The target number is")
    warned = env.step("no idea \x00 ]][[ 🤷")
    assert not warned.done and warned.reward == 0.0
    assert warned.observation.startswith("You attempted an invalid move.")
    ended = env.step("still nothing")  # TextArena allows one invalid move in a row
    closeness = 1 - abs(10 - secret_of(example)) / 19  # GuessTheNumber's own partial credit
    assert ended.done and ended.reward == pytest.approx(closeness) and ended.reward < 1.0
    assert env.step("after the end") == Step(done=True)
    # without partial credit the same play pays 0.0, and a win still 1.0
    strict = load_task(SPEC, partial_credit=False)
    env = strict.environment(example)
    for response in ["[10]", "x"]:
        assert not env.step(response).done
    assert env.step("y") == Step(ended.observation, reward=0.0, done=True)
    assert strict.environment(example).step(f"[{secret_of(example)}]").reward == 1.0


def test_a_game_that_raises_ends_the_episode_with_reward_zero(task, monkeypatch, caplog):
    env = task.environment(task.test()[0])

    def broken(action):
        raise KeyError("board")

    monkeypatch.setattr(env.env, "step", broken)
    step = env.step("[3]")
    assert step.done and step.reward == 0.0 and "KeyError" in step.observation
    assert "raised in step" in caplog.text


def test_episodes_replay_from_their_seed_and_leave_the_global_generators_alone():
    # 2048 draws a new tile after every move: the episode's own generator must drive it
    game = load_task("textarena:2048-v0-ultra-easy", size=20)
    example = game.test()[0]
    first, second = game.environment(example), game.environment(example)
    random.seed(123)
    np.random.seed(123)
    expected = random.random(), np.random.random()
    random.seed(123)
    np.random.seed(123)
    for move in ["[Up]", "[Left]", "[Down]", "[Right]"]:
        a = first.step(move)
        random.random()  # other code drawing between the episodes' turns
        b = second.step(move)
        assert a == b
    assert not a.done and "Score:" in a.observation
    random.seed(123)
    np.random.seed(123)
    assert (random.random(), np.random.random()) == expected
    seen, _, _ = library_game("2048-v0-ultra-easy", example.columns["ta_seed"],
                              ["[Up]", "[Left]", "[Down]", "[Right]"])
    assert a.observation == "\n".join(seen[-1])


def test_the_games_options_are_task_options_and_distinct_games_can_be_off():
    small = load_task(SPEC, max_number=8, test_fraction=0.3)
    assert "between 1 and 8" in small.train()[0].question
    assert len(small.train()) + len(small.test()) == 8
    mines = load_task("textarena:Minesweeper-v0-small", distinct_games=False, size=12)
    seeds = sorted(e.columns["ta_seed"] for e in [*mines.train(), *mines.test()])
    assert seeds == list(range(12))


def test_without_textarena_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ConfigError, match=r"pip install 'postrl\[textarena\]'"):
        load_task(SPEC)


@pytest.mark.parametrize(("spec", "options", "message"), [
    ("textarena:GuessTheNumbr-v0", {}, "unknown TextArena game 'GuessTheNumbr-v0' "),
    ("textarena:TicTacToe-v0", {}, "textarena:TicTacToe-v0: not a single-player game"),
    ("textarena:TowerOfHanoi-v0", {}, "all deal the same starting game"),
    (SPEC, {"max_numbr": 3}, "task option 'max_numbr' does not apply"),
    (SPEC, {"partial_credit": "yes"}, "partial_credit must be true or false"),
    (SPEC, {"size": 1}, "size must be an integer >= 2"),
])
def test_bad_games_and_options_are_config_errors_naming_them(spec, options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_task(spec, **options)


def test_a_recipe_trains_on_a_textarena_game(tmp_path):
    from postrl.train.trainer import Trainer
    from tests.train.test_trainer import read_metrics, tiny_config

    cfg = tiny_config(tmp_path, "dr_grpo", f"task={SPEC}", "stop=[e]", "max_turns=3",
                      "max_new_tokens=16", "steps=1", "rewards=[environment]")
    Trainer(cfg).train()
    [row] = read_metrics(tmp_path / "dr_grpo")
    assert 1 <= row["episode/turns_mean"] <= 3
    assert row["episode/env_tokens_mean"] >= 0
