"""Countdown verifier: reach a target with + - * / over given numbers, each used once.

The expression is read by a hand-written tokenizer and recursive-descent parser over exact
fractions, never ``eval``: anything but integer literals, the four operators and parentheses is
rejected. Unary signs are rejected too, so a negation cannot sneak in an extra operation.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from postrl.rewards.math_answer import completion_text, last_answer_line, last_boxed

MAX_EXPRESSION_CHARS = 200
_OPERATORS = "+-*/()"
# Spellings models use for the operators, mapped to the ASCII ones.
_ALIASES = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "·": "*", "÷": "/", "−": "-"}
_TRAILING_RESULT = re.compile(r"=\s*-?\d+(?:\.\d+)?\s*$")
_ARITHMETIC_CHARS = re.compile(r"[\d\s+\-*/()]+")


def tokenize(expression: str) -> list[str | int]:
    """Integer literals and the characters ``+ - * / ( )``; ValueError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens: list[str | int] = []
    index = 0
    while index < len(expression):
        char = expression[index]
        if char in " \t":
            index += 1
        elif char in _OPERATORS:
            tokens.append(char)
            index += 1
        elif "0" <= char <= "9":
            end = index
            while end < len(expression) and "0" <= expression[end] <= "9":
                end += 1
            tokens.append(int(expression[index:end]))
            index = end
        else:
            raise ValueError(f"unexpected character {char!r} at position {index}")
    return tokens


class _Parser:
    """expression := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
    factor := INTEGER | '(' expression ')'."""

    def __init__(self, tokens: list[str | int]) -> None:
        self.tokens = tokens
        self.position = 0

    def peek(self) -> str | int | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str | int | None:
        token = self.peek()
        self.position += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            operator, right = self.take(), self.factor()
            if operator == "*":
                value *= right
            elif right == 0:
                raise ValueError("division by zero")
            else:
                value /= right
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if isinstance(token, int):
            return Fraction(token)
        if token == "(":
            value = self.expression()
            if self.take() != ")":
                raise ValueError("missing closing parenthesis")
            return value
        raise ValueError(f"expected a number or '(' but found {token!r}")


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError if it is not one."""
    parser = _Parser(tokenize(expression))
    if not parser.tokens:
        raise ValueError("empty expression")
    value = parser.expression()
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r} after the expression")
    return value


def expression_numbers(expression: str) -> list[int]:
    """The integer literals of an expression, in order."""
    return [token for token in tokenize(expression) if isinstance(token, int)]


def _normalise(candidate: str) -> str:
    """Map operator spellings to ASCII; drop ``$``, ``\\(``, ``\\)``, a full stop and ``= N``."""
    text = candidate
    for spelling, ascii_operator in _ALIASES.items():
        text = text.replace(spelling, ascii_operator)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\(", "").replace("\\)", "")
    text = text.strip().strip("$*").strip().rstrip(".")
    return _TRAILING_RESULT.sub("", text).strip()


def _looks_arithmetic(line: str) -> bool:
    """Only digits, operators and parentheses, with at least one digit and one operator."""
    return (
        len(line) <= MAX_EXPRESSION_CHARS
        and _ARITHMETIC_CHARS.fullmatch(line) is not None
        and any(char.isdigit() for char in line)
        and any(char in "+-*/" for char in line)
    )


def extract_expression(text: str) -> str | None:
    """The last ``Answer:`` line, else the last ``\\boxed{}``, else the last line that looks like
    an arithmetic expression (optionally ending in ``= N``)."""
    answer = last_answer_line(text)
    if answer is not None:
        boxed_inside = last_boxed(answer)
        return _normalise(boxed_inside if boxed_inside is not None else answer)
    boxed = last_boxed(text)
    if boxed is not None:
        return _normalise(boxed)
    for line in reversed(text.splitlines()):
        candidate = _normalise(line)
        if _looks_arithmetic(candidate):
            return candidate
    return None


def is_countdown_solution(expression: str, numbers: Iterable[Any], target: Any) -> bool:
    """True when ``expression`` uses each of ``numbers`` exactly once and equals ``target``."""
    try:
        used = expression_numbers(expression)
        value = evaluate_expression(expression)
    except ValueError:
        return False
    return Counter(used) == Counter(int(n) for n in numbers) and value == Fraction(target)


def countdown_reward(
    prompts: list[str], completions: list[Any], numbers: list[Any], target: list[Any], **_: Any
) -> list[float | None]:
    """1.0 when the completion's expression reaches ``target`` using each of ``numbers`` once
    (the Countdown game, as in TinyZero, Pan et al. 2025), else 0.0."""
    rewards: list[float | None] = []
    for completion, sample_numbers, sample_target in zip(completions, numbers, target, strict=True):
        expression = extract_expression(completion_text(completion))
        solved = expression is not None and is_countdown_solution(
            expression, sample_numbers, sample_target
        )
        rewards.append(1.0 if solved else 0.0)
    return rewards
