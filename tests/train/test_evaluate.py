"""pass@k against hand-worked numbers and brute force; evaluate() on the tiny model; the CLI."""

from __future__ import annotations

import argparse
import itertools
import json
import math

import pytest

from postrl.errors import ConfigError
from postrl.models import load_policy
from postrl.rollout.base import EpisodeStats
from postrl.tasks import load_task
from postrl.train.evaluate import (
    EvalSettings,
    Sampled,
    add_eval_arguments,
    count_correct,
    evaluate,
    format_result,
    parse_ks,
    parse_task_options,
    pass_at_k,
    resolve_eval_model,
    run_eval,
)

# --- the estimator (Chen et al. 2021, eq. 1) ---------------------------------------------------


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct: 1 - C(3,1)/C(5,1) = 1 - 3/5
        (10, 3, 4, 1 - 35 / 210),  # C(7,4) = 35, C(10,4) = 210
        (8, 1, 8, 1.0),  # all samples drawn: the correct one is among them
        (6, 0, 3, 0.0),  # no correct sample
        (6, 6, 3, 1.0),  # all correct
        (6, 4, 3, 1.0),  # n - c = 2 < k = 3: every 3-subset holds a correct sample
        (4, 1, 2, 1 - 3 / 6),  # C(3,2) = 3, C(4,2) = 6
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 2), (5, 3), (6, 1), (7, 4), (8, 8)])
def test_pass_at_k_is_the_mean_over_all_k_subsets(n: int, k: int) -> None:
    for c in range(n + 1):
        outcomes = [i < c for i in range(n)]  # which samples are correct
        subsets = list(itertools.combinations(outcomes, k))
        brute_force = sum(any(subset) for subset in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute_force, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n() -> None:
    exact = 1 - math.comb(1000 - 10, 100) / math.comb(1000, 100)
    assert pass_at_k(1000, 10, 100) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k", "message"), [
    (4, 1, 5, "k <= n"), (4, 5, 2, "c <= n"), (4, -1, 2, "c <= n"), (0, 0, 1, "n >= 1"),
    (4, 1, 0, "k >= 1"),
])
def test_pass_at_k_rejects_impossible_arguments(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


# --- counting correct completions with the task's verifier ----------------------------------


def test_count_correct_uses_the_verifier_on_real_arithmetic_examples() -> None:
    task = load_task("arithmetic")
    first, second = task.test()[:2]
    gold_first, gold_second = int(first.columns["answer"]), int(second.columns["answer"])
    completions = [
        str(gold_first), f"The answer is {gold_first}.", str(gold_first + 1),  # 2 of 3
        "I do not know.", f"{gold_second + 7}", f"\\boxed{{{gold_second}}}",  # 1 of 3
    ]
    prompts = [first.question, second.question]
    assert count_correct("math_answer", [first, second], prompts, completions, 3) == [2, 1]
    assert count_correct("math_answer", [first], prompts[:1], ["nope"], 1) == [0]
    with pytest.raises(ValueError):
        count_correct("math_answer", [first, second], prompts, completions, 2)


# --- evaluate() on the tiny random model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny", seed=0)


def test_evaluate_tiny_gives_consistent_numbers(tiny) -> None:
    model, tokenizer = tiny
    task = load_task("arithmetic")
    settings = EvalSettings(n=4, ks=[2, 1], max_new_tokens=8, seed=0,
                            batch_prompts=3)  # chunks of 3 and 1 prompts
    result = evaluate(model, tokenizer, task, settings)
    assert result.n_problems == 4 and result.samples_per_problem == 2
    assert [row.id for row in result.per_problem] == [ex.id for ex in task.test()[:4]]
    counts = [row.correct for row in result.per_problem]
    assert all(0 <= count <= 2 for count in counts)
    assert sorted(result.pass_at_k) == [1, 2]
    for k in (1, 2):
        expected = sum(pass_at_k(2, count, k) for count in counts) / 4
        assert result.pass_at_k[k] == pytest.approx(expected)
    assert 0 <= result.pass_at_k[1] <= result.pass_at_k[2] <= 1
    greedy = [row.greedy_correct for row in result.per_problem]
    assert result.pass_at_1_greedy == pytest.approx(sum(greedy) / 4)
    assert 1 <= result.mean_length <= 8
    assert result.mean_sampled_length is not None and 1 <= result.mean_sampled_length <= 8
    assert result.seconds > 0


def test_evaluate_reports_sampled_pass_at_1_and_truncation(tiny) -> None:
    model, tokenizer = tiny
    settings = EvalSettings(n=3, ks=[2], max_new_tokens=3, seed=0)  # no k=1 asked
    result = evaluate(model, tokenizer, load_task("arithmetic"), settings)
    counts = [row.correct for row in result.per_problem]
    assert result.pass_at_1_sampled == pytest.approx(sum(c / 2 for c in counts) / 3)
    for share, lengths in ((result.truncated_greedy, result.mean_length),
                           (result.truncated_sampled, result.mean_sampled_length)):
        assert share is not None and 0 <= share <= 1
        assert lengths is not None and (share < 1 or lengths == 3)  # all cut: all at 3 tokens
    text = format_result(result)
    assert "pass@1 (T=1, 2 samples)" in text and "truncated at max_new_tokens (sampled)" in text


def test_a_tool_call_counts_when_one_of_the_episodes_calls_ran() -> None:
    stats = EpisodeStats(turns=(1, 2, 2, 3), rewards=(0.0,) * 4, tool_calls=(0, 1, 1, 2),
                         tool_errors=(0, 0, 1, 1), env_tokens=(0,) * 4, env_seconds=(0.0,) * 4,
                         out_of_turns=(False,) * 4, turn_rewards=((),) * 4)
    sampled = Sampled(["a", "b", "c", "d"], [1, 2, 3, 4], [False] * 4, stats)
    assert sampled.called == [False, True, False, True]
    assert sampled.extra == {"env_reward": [0.0] * 4}
    assert Sampled(["a"], [1], [False], None).called == [False]


@pytest.mark.parametrize(("task", "tools"), [("calculator", True), ("arithmetic", False)])
def test_only_a_task_with_tools_reports_its_share_of_calls(tiny, task, tools) -> None:
    model, tokenizer = tiny
    result = evaluate(model, tokenizer, load_task(task), EvalSettings(n=2, ks=[1, 2],
                                                                     max_new_tokens=4))
    shares = (result.called_greedy, result.called_sampled)
    # the tiny random model writes no call: 0 of its episodes, where there are tools
    assert shares == ((0.0, 0.0) if tools else (None, None))
    assert ("tool call that ran" in format_result(result)) == tools


def test_evaluate_greedy_only_draws_no_samples(tiny) -> None:
    model, tokenizer = tiny
    result = evaluate(model, tokenizer, load_task("arithmetic"),
                      EvalSettings(n=2, ks=[1], max_new_tokens=4))
    assert result.samples_per_problem == 0 and result.pass_at_k == {}
    assert result.mean_sampled_length is None and result.n_problems == 2
    assert result.pass_at_1_sampled is None and result.truncated_sampled is None


# --- CLI helpers ----------------------------------------------------------------------------


def test_parse_ks() -> None:
    assert parse_ks("8,1") == [1, 8]
    assert parse_ks(" 1 , 4 ,") == [1, 4]
    for bad in ("", "0", "1,x", "-2", "1.5"):
        with pytest.raises(ConfigError, match="--k"):
            parse_ks(bad)


def test_parse_task_options() -> None:
    assert parse_task_options(["digits=2", "operators=+-"]) == {"digits": 2, "operators": "+-"}
    with pytest.raises(ConfigError, match="--task-option"):
        parse_task_options(["digits"])


def test_resolve_eval_model(tmp_path) -> None:
    assert resolve_eval_model("tiny") == "tiny"
    assert resolve_eval_model(str(tmp_path)) == str(tmp_path)  # no final/: a model directory
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert resolve_eval_model(str(tmp_path)) == str(tmp_path / "final")


def test_run_eval_json(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--task", "arithmetic", "--n", "2", "--k",
                              "1,2", "--max-new-tokens", "4", "--json"])
    assert run_eval(args) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["n_problems"] == 2 and output["samples_per_problem"] == 2
    assert set(output["pass_at_k"]) == {"1", "2"} and len(output["per_problem"]) == 2
    args = parser.parse_args(["--model", "tiny", "--n", "1", "--k", "1", "--max-new-tokens", "2"])
    assert run_eval(args) == 0
    assert "pass@1 (greedy)" in capsys.readouterr().out


@pytest.mark.parametrize("task", ["arithmetic", "guess_number"])
def test_evaluate_ends_responses_at_the_stop_strings_training_uses(tiny, task) -> None:
    model, tokenizer = tiny
    lengths = {}
    for stop in ((), ("e",)):
        settings = EvalSettings(n=4, ks=[4], max_new_tokens=16, seed=0, max_turns=2, stop=stop)
        result = evaluate(model, tokenizer, load_task(task), settings)
        lengths[stop] = result.mean_sampled_length
    assert lengths[("e",)] < lengths[()]  # "e" ends most of the tiny model's responses early


def test_run_eval_passes_turns_and_stop_strings_with_escapes_read(monkeypatch, capsys):
    import postrl.train.evaluate as module

    seen = []
    real = module.evaluate
    monkeypatch.setattr(module, "evaluate", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--task", "guess_number", "--n", "1", "--k",
                              "1", "--max-new-tokens", "6", "--max-turns", "2",
                              "--stop", "\\n", "--stop", "e"])
    assert run_eval(args) == 0
    (settings,) = seen
    assert settings.max_turns == 2 and settings.stop == ("\n", "e")
