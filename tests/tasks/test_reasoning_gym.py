"""``reasoning_gym:NAME`` and its verifier, on the real reasoning-gym (its scorers unmocked)."""

import json
import sys

import pytest

from postrl.errors import ConfigError
from postrl.rewards import load_reward
from postrl.rewards.reasoning_gym import first_answer
from postrl.tasks import load_task
from postrl.tasks.reasoning_gym import ANSWER_INSTRUCTION
from postrl.tasks.registry import TASK_FORMS

pytest.importorskip("reasoning_gym")

SPEC = "reasoning_gym:chain_sum"
OPTIONS = {"min_terms": 2, "max_terms": 3, "max_digits": 2, "size": 300}


@pytest.fixture(scope="module")
def task():
    return load_task(SPEC, **OPTIONS)


def reward_of(example, completions):
    columns = {name: [value] * len(completions) for name, value in example.columns.items()}
    return load_reward("reasoning_gym")(["prompt"] * len(completions), completions, **columns)


@pytest.mark.parametrize(("text", "answer"), [
    ("Answer: 12", "12"),
    ("reasoning\n  answer :12.", "12"),
    ("**Answer:** 12", "12"),
    ("**Answer**: 12", "12"),
    ("## Answer: **12**", "12"),
    ("- ANSWER: twelve and more", "twelve and more"),
    ("Answer: 12\nAnswer: 13", "12"),
    ("So, the answer is 12.", "12"),
    ("The final answer is: **12**.", "12"),
    ("I think the answer is 12\nAnswer: 13", "12"),
    ("the answer is\nAnswer: 13", None),  # the first answer line is empty: no answer
    ("The answer: 12", None),
    ("Final answer: 12", None),
    ("Answers: 12", None),
    ("Answer:\n12", None),
    ("no answer at all", None),
])
def test_first_answer_line(text, answer):
    assert first_answer(text) == answer


def test_the_gold_answer_scores_one_and_only_the_first_answer_line_counts(task):
    example = task.test()[0]
    gold = example.columns["answer"]
    wrong = str(int(gold) + 1)
    rewards = reward_of(example, [
        f"Let me add.\nAnswer: {gold}",
        f"**Answer:** {gold}\nAnswer: {wrong}",  # later lines are ignored
        f"Answer: {wrong}\nAnswer: {gold}",      # ... whichever way round
        f"So, the answer is {gold}.",            # the phrase small models write
        f"{gold} is what I get",                 # no answer line
        "",
    ])
    assert rewards == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_every_gold_answer_is_verified(task):
    for example in [*task.test(), *task.train()[:50]]:
        assert reward_of(example, [f"Answer: {example.columns['answer']}"]) == [1.0]


@pytest.mark.parametrize("name", ["leg_counting", "number_sorting", "fraction_simplification"])
def test_the_datasets_own_scorer_verifies_its_gold(name):
    example = load_task(f"reasoning_gym:{name}", size=40, test_fraction=0.5).test()[0]
    gold = example.columns["answer"]
    right, wrong = reward_of(example, [f"Let me see.\nAnswer: {gold}", "Answer: 0/0"])
    assert right == 1.0 and wrong < 1.0  # some scorers give partial credit (0.05 here)


def test_question_columns_and_json(task):
    example = task.test()[0]
    assert example.question.endswith(ANSWER_INSTRUCTION)
    assert example.id.startswith(f"{SPEC}/test/")
    assert example.columns["rg_dataset"] == "chain_sum"
    assert example.columns["rg_config"]["max_digits"] == 2
    json.dumps(example.columns)  # logged with the samples
    assert task.name == SPEC and task.default_rewards == ("reasoning_gym",)


def test_splits_are_disjoint_and_the_seed_only_orders_train(task):
    train = [ex.question for ex in task.train()]
    test = [ex.question for ex in task.test()]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test) and test
    reseeded = load_task(SPEC, **OPTIONS, seed=7)
    assert [ex.question for ex in reseeded.test()] == test
    assert sorted(ex.question for ex in reseeded.train()) == sorted(train)
    assert [ex.question for ex in reseeded.train()] != train
    assert [ex.question for ex in load_task(SPEC, **OPTIONS).train()] == train


def test_a_config_field_changes_the_problems(task):
    wider = load_task(SPEC, **{**OPTIONS, "max_digits": 3})
    assert {ex.question for ex in wider.test()} != {ex.question for ex in task.test()}


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        load_task(SPEC, max_digitz=2)
    message = str(error.value)
    assert "'max_digitz'" in message
    for valid in ("seed", "test_fraction", "size", "min_terms", "max_digits"):
        assert valid in message


def test_unknown_dataset_lists_close_names():
    with pytest.raises(ConfigError, match="unknown reasoning-gym dataset 'chain_summ'.*chain_sum"):
        load_task("reasoning_gym:chain_summ")
    with pytest.raises(ConfigError, match="a dataset name is needed"):
        load_task("reasoning_gym:")


def test_options_reasoning_gym_rejects_are_config_errors():
    with pytest.raises(ConfigError, match="reasoning-gym rejected the options"):
        load_task(SPEC, min_terms=5, max_terms=2)


def test_missing_package_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ConfigError) as error:
        load_task("reasoning_gym:leg_counting")
    assert str(error.value) == ("task reasoning_gym:leg_counting needs the optional extra: "
                                "pip install 'postrl[reasoning]'")


def test_listed_among_the_task_forms():
    assert any(form.startswith("reasoning_gym:NAME") for form in TASK_FORMS)
