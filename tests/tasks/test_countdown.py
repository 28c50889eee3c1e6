"""Countdown: every target is reachable, checked by an independent exact evaluation."""

import ast
import random
from collections import Counter
from fractions import Fraction

import pytest

from postrl.errors import ConfigError
from postrl.tasks.countdown import Built, CountdownTask, combine, random_expression

BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Value (exact) and the numbers used, walking the syntax tree (no eval)."""

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            (left, used_left), (right, used_right) = walk(node.left), walk(node.right)
            return BINARY[type(node.op)](left, right), used_left + used_right
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value), [node.value]
        raise AssertionError(f"unexpected syntax in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.fixture(scope="module")
def task():
    return CountdownTask()


def test_every_target_is_reached_by_its_solution(task):
    for ex in (*task.train(), *task.test()):
        value, used = evaluate(ex.columns["solution"])
        assert value == ex.columns["target"]
        assert Counter(used) == Counter(ex.columns["numbers"])
        assert 1 <= ex.columns["target"] <= 100


def test_columns_and_question_format(task):
    ex = task.train()[0]
    numbers, target = ex.columns["numbers"], ex.columns["target"]
    assert isinstance(numbers, list) and len(numbers) == 3
    assert all(isinstance(n, int) and 1 <= n <= 10 for n in numbers)
    assert isinstance(target, int)
    assert ex.question == (
        f"Using the numbers {numbers}, each exactly once, with + - * / and parentheses, "
        f"make {target}. Reply with the expression only."
    )


def test_splits_are_disjoint_by_sorted_numbers_and_target(task):
    def keys(examples):
        return [(tuple(sorted(ex.columns["numbers"])), ex.columns["target"]) for ex in examples]

    train, test = keys(task.train()), keys(task.test())
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    assert len(train) + len(test) == 2000
    assert 100 <= len(test) <= 300  # about 10%


def test_deterministic_and_the_seed_only_orders_train(task):
    again, reseeded = CountdownTask(), CountdownTask(seed=3)
    assert again.train() == task.train() and again.test() == task.test()
    assert reseeded.test() == task.test()
    assert [ex.id for ex in reseeded.train()] != [ex.id for ex in task.train()]
    assert sorted(ex.id for ex in reseeded.train()) == sorted(ex.id for ex in task.train())


def test_combine_by_hand():
    three, two, zero = Built("3", Fraction(3)), Built("2", Fraction(2)), Built("0", Fraction(0))
    assert combine(three, "/", two) == Built("(3 / 2)", Fraction(3, 2))
    assert combine(three, "-", two) == Built("(3 - 2)", Fraction(1))
    assert combine(three, "/", zero) is None
    built = random_expression([3, 5, 2], random.Random(0))
    assert built is None or evaluate(built.text)[0] == built.value


def test_larger_puzzles_stay_reachable():
    task = CountdownTask(count=4, max_number=50, num_problems=300)
    for ex in task.test():
        value, used = evaluate(ex.columns["solution"])
        assert value == ex.columns["target"] and sorted(used) == sorted(ex.columns["numbers"])


@pytest.mark.parametrize(
    ("options", "named"),
    [({"count": 1}, "count"), ({"max_number": 0}, "max_number"), ({"test_fraction": 0}, "test")],
)
def test_bad_options_name_the_option(options, named):
    with pytest.raises(ConfigError, match=named):
        CountdownTask(**options)
