"""Every gold solution of GSM8K's test split is scored correct, and wrong once its final number
is changed (issue 3, "Tests must show")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from postrl.rewards import math_answer
from postrl.rewards.math_answer import parse_number

GSM8K_TEST = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="module")
def solutions() -> list[str]:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"GSM8K test split not found at {GSM8K_TEST}")
    lines = GSM8K_TEST.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["answer"] for line in lines if line.strip()]


def _with_final_number_changed(solution: str) -> str:
    work, final = solution.rsplit("####", 1)
    number = parse_number(final)
    assert number is not None, f"unparseable final answer {final!r}"
    return f"{work}#### {number + 1}"


def test_the_split_is_complete(solutions: list[str]) -> None:
    assert len(solutions) == 1319


def test_gold_solutions_score_correct(solutions: list[str]) -> None:
    rewards = math_answer([""] * len(solutions), solutions, answer=solutions)
    wrong = [index for index, reward in enumerate(rewards) if reward != 1.0]
    assert not wrong, f"gold solutions scored wrong at lines {[i + 1 for i in wrong][:10]}"


def test_changed_final_number_scores_wrong(solutions: list[str]) -> None:
    changed = [_with_final_number_changed(solution) for solution in solutions]
    rewards = math_answer([""] * len(solutions), changed, answer=solutions)
    right = [index for index, reward in enumerate(rewards) if reward != 0.0]
    assert not right, f"changed solutions scored correct at lines {[i + 1 for i in right][:10]}"
