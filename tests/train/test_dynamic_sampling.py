"""Which groups dynamic sampling keeps (DAPO §3.2): by default those the verifier marks
partly correct, 0 < #correct < G, whatever shaping adds to their rewards; with
``dynamic_sampling_by=reward``, those whose rewards are not all equal."""

import pytest
import torch

from postrl.cli import main
from postrl.components import COMPONENTS, differing
from postrl.recipes import get_recipe
from postrl.rollout.base import Rollouts
from postrl.tasks.base import Example
from postrl.train.sampling import Group, collect


def group(correct: list[bool], rewards: list[float], length: int = 3) -> Group:
    rows = len(correct)
    rollouts = Rollouts(prompt_ids=[[1, 2]] * rows,
                        response_ids=torch.ones(rows, length, dtype=torch.long),
                        response_mask=torch.ones(rows, length, dtype=torch.bool),
                        logprobs=torch.zeros(rows, length),
                        lengths=torch.full((rows,), length), finish_reasons=["eos"] * rows,
                        texts=["x"] * rows, group_size=rows)
    return Group(Example("e", "q", "a"), "q", rollouts, rewards, {}, correct)


ALL_WRONG_SHAPED = ([False] * 4, [0.0, -0.3, 0.0, -1.0])  # overlong penalty on two of them
PARTLY_RIGHT = ([True, False, False, True], [1.0, 0.0, 0.0, 1.0])
ALL_RIGHT = ([True] * 4, [1.0] * 4)


@pytest.mark.parametrize(("members", "by_correctness", "by_reward"), [
    (ALL_WRONG_SHAPED, False, True),
    (PARTLY_RIGHT, True, True),
    (ALL_RIGHT, False, False),
    (([False] * 4, [0.0] * 4), False, False),
])
def test_a_group_is_useful_by_its_correctness_or_its_rewards(members, by_correctness,
                                                             by_reward):
    assert group(*members).useful("correctness") is by_correctness
    assert group(*members).useful("reward") is by_reward


def test_collect_resamples_until_enough_groups_are_partly_correct_and_counts_waste():
    rounds = [[group(*ALL_WRONG_SHAPED), group(*PARTLY_RIGHT)],
              [group(*ALL_RIGHT), group(*PARTLY_RIGHT)],
              [group(*PARTLY_RIGHT), group(*PARTLY_RIGHT)]]
    collected = collect(lambda r: rounds[r], 2, True, 3)
    assert collected.rounds == 2 and collected.groups == [rounds[0][1], rounds[1][1]]
    assert collected.tokens_wasted == 2 * 4 * 3 and collected.tokens_generated == 4 * 4 * 3
    by_reward = collect(lambda r: rounds[r], 2, True, 3, useful_by="reward")
    assert by_reward.rounds == 1 and by_reward.groups == rounds[0]  # shaping made it useful
    plain = collect(lambda r: rounds[r], 2, False, 3)
    assert plain.rounds == 1 and plain.groups == rounds[0] and plain.tokens_wasted == 0


def test_dapo_filters_on_correctness_and_explain_says_so(capsys):
    dapo = get_recipe("dapo")
    assert dapo.dynamic_sampling and dapo.dynamic_sampling_by == "correctness"
    assert main(["explain", "dapo"]) == 0
    assert "dynamic sampling: on by correctness" in capsys.readouterr().out
    (component,) = [c for c in COMPONENTS if c.title == "dynamic sampling"]
    by_reward = dapo.with_(dynamic_sampling_by="reward")
    assert component.describe(by_reward).startswith("on by reward")
    assert "std_g(R) > 0" in component.formula(by_reward)
    assert [c.title for c in differing(dapo, by_reward)] == ["dynamic sampling"]
