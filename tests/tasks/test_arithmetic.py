"""The synthetic arithmetic task: hand-checked answers, disjoint splits, determinism."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.errors import ConfigError
from postrl.tasks.arithmetic import ArithmeticTask, operand_range, parse_operators
from postrl.tasks.splits import stable_fraction


def questions(examples):
    return [ex.question for ex in examples]


def one_digit_space(op):
    template = "What is {} {} {}? Reply with only the number."
    return {template.format(a, op, b) for a in range(10) for b in range(10)}


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_one_digit_splits_are_disjoint_and_cover_the_space(op):
    task = ArithmeticTask(operators=op)
    train, test = questions(task.train()), questions(task.test())
    assert len(train) + len(test) == 100
    assert not set(train) & set(test)
    assert set(train) | set(test) == one_digit_space(op)
    assert len(set(train)) == len(train)
    assert 1 <= len(test) <= 25  # about 10% of 100 by the hash


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is 6 + 3? Reply with only the number.", "9"),
        ("What is 0 + 0? Reply with only the number.", "0"),
        ("What is 9 + 9? Reply with only the number.", "18"),
        ("What is 3 - 8? Reply with only the number.", "-5"),
        ("What is 8 - 3? Reply with only the number.", "5"),
        ("What is 7 * 8? Reply with only the number.", "56"),
        ("What is 0 * 9? Reply with only the number.", "0"),
    ],
)
def test_answers_by_hand(question, answer):
    task = ArithmeticTask(operators="+-*")
    answers = {ex.question: ex.columns["answer"] for ex in (*task.train(), *task.test())}
    assert answers[question] == answer
    assert len(answers) == 300


def test_two_digit_operands_have_exactly_two_digits():
    task = ArithmeticTask(operators="+", digits=2)
    assert len(task.train()) + len(task.test()) == 90 * 90
    example = next(ex for ex in task.train() if ex.question.startswith("What is 47 + 85?"))
    assert example.columns["answer"] == "132"
    assert operand_range(1) == range(0, 10)
    assert operand_range(3) == range(100, 1000)


def test_large_spaces_are_sampled_deterministically_and_stay_disjoint():
    task = ArithmeticTask(operators="*", digits=3, max_problems=500)
    again = ArithmeticTask(operators="*", digits=3, max_problems=500, seed=1)
    train, test = questions(task.train()), questions(task.test())
    assert len(train) + len(test) == 500
    assert not set(train) & set(test)
    assert set(train) == set(questions(again.train())) and test == questions(again.test())
    for ex in task.train()[:20]:
        a, b = (int(word.rstrip("?")) for word in ex.question.split()[2:5:2])
        assert 100 <= a <= 999 and 100 <= b <= 999 and ex.columns["answer"] == str(a * b)


def test_deterministic_and_the_seed_only_orders_train():
    first, second, other = ArithmeticTask("+-"), ArithmeticTask("+-"), ArithmeticTask("+-", seed=7)
    assert first.train() == second.train() and first.test() == second.test()
    assert questions(other.train()) != questions(first.train())
    assert sorted(questions(other.train())) == sorted(questions(first.train()))
    assert other.test() == first.test()
    assert {ex.id for ex in other.train()} == {ex.id for ex in first.train()}


def test_a_problem_is_held_out_whatever_the_other_operators():
    plus_test = set(questions(ArithmeticTask("+").test()))
    all_test = set(questions(ArithmeticTask("+-*").test()))
    assert plus_test == {q for q in all_test if " + " in q}


def test_stable_fraction_is_sha256_and_independent_of_hash_seed():
    # SHA-256("") starts e3b0c44298fc1c14 (the well-known empty-string digest)
    assert stable_fraction("") == int("e3b0c44298fc1c14", 16) / 2**64
    code = "from postrl.tasks import ArithmeticTask as A; print(A('+-*').test()[0].question)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    repo_root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=repo_root
    )
    assert out.stdout.strip() == ArithmeticTask("+-*").test()[0].question


@settings(max_examples=15, deadline=None)
@given(
    ops=st.sets(st.sampled_from("+-*"), min_size=1),
    fraction=st.floats(0.05, 0.5),
    seed=st.integers(0, 1000),
)
def test_splits_partition_the_space_for_any_options(ops, fraction, seed):
    task = ArithmeticTask("".join(sorted(ops)), seed=seed, test_fraction=fraction)
    train, test = set(questions(task.train())), set(questions(task.test()))
    assert not train & test
    assert train | test == set().union(*(one_digit_space(op) for op in ops))


def test_operator_forms():
    assert parse_operators("+-*") == ("+", "-", "*")
    assert parse_operators("+, -") == ("+", "-")
    assert parse_operators(["*", "*"]) == ("*",)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"operators": "/"}, "operators"),
        ({"operators": ""}, "operators"),
        ({"digits": 0}, "digits"),
        ({"digits": "2"}, "digits"),
        ({"test_fraction": 1.5}, "test_fraction"),
        ({"test_fraction": 0.0001}, "test_fraction"),  # no test problem left among 100
    ],
)
def test_bad_options_name_the_option(options, named):
    with pytest.raises(ConfigError, match=named):
        ArithmeticTask(**options)
