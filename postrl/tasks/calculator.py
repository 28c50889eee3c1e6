"""Multi-step arithmetic with a calculator tool: a tool-use environment task.

Each problem is ``a * b + c`` or ``a * b - c`` (two-digit ``a`` and ``b``, three-digit ``c``),
hard to do in one's head for a small model and easy with the tool ``calculate``, which the
prompt offers (``postrl.envs.tools``). The model may call it any number of times within
``max_turns``; its first turn without a tool call is its answer, and the episode pays 1.0
when the last integer of that turn is the result, else 0.0. Problems are split by a stable
hash of the expression; the problem set depends only on the options, the seed only orders
``train()``.

``demonstrations`` worked episodes (a call, its result, the answer) precede every question as
earlier conversation: few-shot prompting (Brown et al. 2020, arXiv 2005.14165) for a model that
was never taught the call format. Without them SmolLM2-135M-Instruct writes no well-formed
call at all, so every group's rewards are equal and RL has nothing to learn from; with them it
writes calls from the first step. Demonstrated problems are never asked.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from postrl.envs.tools import ToolEnvironment, call_text, response_text
from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits
from postrl.tasks.chat import Message
from postrl.tasks.splits import (
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

QUESTION = "What is {expression}? Use the calculator tool, then reply with the number only."
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}
_INTEGER = re.compile(r"-?\d+")
_DEMONSTRATED = ("23 * 41 + 517", "68 * 19 - 304")  # worked in the prompt, never asked


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "(12 + 3) * 4"
    """
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def final_integer(text: str) -> int | None:
    """The last integer of the model's answering turn (None without one)."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


class CalculatorTask(FixedSplits):
    """``a * b ± c`` problems with the ``calculate`` tool; column ``answer``."""

    name = "calculator"
    default_rewards: tuple[str, ...] = ("environment",)
    tools = (calculate,)

    def __init__(self, num_problems: int = 2000, seed: int = 0,
                 test_fraction: float = 0.1, demonstrations: int = 2) -> None:
        self.num_problems = check_int("num_problems", num_problems, 2)
        self.seed = check_int("seed", seed, 0)
        self.test_fraction = check_test_fraction(test_fraction)
        count = check_int("demonstrations", demonstrations, 0)
        if count > len(_DEMONSTRATED):
            raise ConfigError(f"demonstrations must be at most {len(_DEMONSTRATED)}, got {count}")
        self.demonstrations = demonstration_messages(_DEMONSTRATED[:count])
        rng = random.Random("calculator")
        problems = {}
        while len(problems) < self.num_problems:
            a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(100, 999)
            sign = rng.choice("+-")
            expression = f"{a} * {b} {sign} {c}"
            if expression not in _DEMONSTRATED:
                problems[expression] = a * b + c if sign == "+" else a * b - c
        train, test = split_by_hash(((e, (e, v)) for e, v in problems.items()),
                                    self.test_fraction)
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(_examples(train, "calculator/train"), self.seed))
        self._test = tuple(_examples(test, "calculator/test"))

    def environment(self, example: Example) -> ToolEnvironment:
        answer = int(example.columns["answer"])
        return ToolEnvironment({"calculate": calculate},
                               finish=lambda text: float(final_integer(text) == answer))


def demonstration_messages(expressions: tuple[str, ...]) -> tuple[Message, ...]:
    """One worked episode per expression, in the formats the episode itself uses: the
    question, the model's call, the tool's result and the answer."""
    messages: list[Message] = []
    for expression in expressions:
        result = calculate(expression)
        messages += [
            {"role": "user", "content": QUESTION.format(expression=expression)},
            {"role": "assistant", "content": call_text("calculate", {"expression": expression})},
            {"role": "tool", "content": response_text("calculate", result)},
            {"role": "assistant", "content": result}]
    return tuple(messages)


def _examples(problems: list[tuple[str, int]], prefix: str) -> list[Example]:
    return [Example(id=f"{prefix}/{i}", question=QUESTION.format(expression=expression),
                    columns={"answer": str(answer)})
            for i, (expression, answer) in enumerate(problems)]
