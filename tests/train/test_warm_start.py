"""The supervised warm start from the teacher's samples: the verifier picks the targets, the
student learns them after its own prompt, and the teacher's tokens are paid for."""

import json

import pytest

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.telemetry.names import is_declared
from postrl.train.trainer import Trainer
from tests.train.rewards_for_tests import length_parity
from tests.train.test_distill import config, teacher_dir  # noqa: F401 (a fixture)


def accepting_even_lengths(trainer: Trainer) -> Trainer:
    """The random model never answers correctly: its verdict becomes length_parity's."""
    trainer.grader.verifier, trainer.grader.verifier_name = length_parity, "length_parity"
    return trainer


def test_the_student_learns_the_accepted_samples_of_the_teacher(tmp_path, teacher_dir):  # noqa: F811
    trainer = accepting_even_lengths(Trainer(config(
        tmp_path, f"teacher.model={teacher_dir}", "teacher.warm_start_prompts=4",
        "teacher.warm_start_steps=16", "steps=1", "lr=3e-3")))
    trainer.train()
    row = json.loads(trainer.run.metrics_path.read_text().splitlines()[0])
    assert row["step"] == 1 and row["warm_start/samples"] == 4 * 4
    assert 0 < row["warm_start/kept"] < row["warm_start/samples"]
    assert row["warm_start/nll_last"] < 0.8 * row["warm_start/nll_first"]
    # the teacher's tokens are part of the run's cost, beside the step's own 2 x 4 responses
    step_tokens = round(row["length/mean"] * 8)
    assert row["rollout/tokens_generated"] == row["warm_start/tokens"] + step_tokens
    assert row["time/warm_start_s"] > 0
    assert all(is_declared(name) for name in row)


def test_a_warm_start_that_spends_the_budget_is_logged_though_no_step_runs(tmp_path):
    trainer = accepting_even_lengths(Trainer(config(
        tmp_path, "teacher.model=self", "teacher.system_prompt=Think about digits.",
        "teacher.warm_start_prompts=2", "teacher.warm_start_steps=1", "token_budget=10",
        "eval_every=5", "eval_n=2", "eval_samples=0")))
    trainer.train()
    rows = [json.loads(line) for line in trainer.run.metrics_path.read_text().splitlines()]
    assert trainer.step == 0 and [r["step"] for r in rows] == [0, 0]
    assert "eval/accuracy" in rows[0] and rows[0]["rollout/tokens_generated"] == 0
    assert rows[1]["warm_start/samples"] == 8
    assert rows[1]["rollout/tokens_generated"] == rows[1]["warm_start/tokens"] >= 10


def test_a_self_teacher_samples_with_its_own_prompt_before_any_update(tmp_path):
    trainer = accepting_even_lengths(Trainer(config(
        tmp_path, "teacher.model=self", "teacher.system_prompt=Think about digits.",
        "teacher.warm_start_prompts=2", "teacher.warm_start_steps=1", "steps=1")))
    seen = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda ids, *a, **k: (seen.append(ids), generate(ids, *a, **k))[1]
    trainer.train()
    first = trainer.tokenizer.decode(seen[0][0])  # the warm start's call comes first
    assert "Think about digits." in first
    assert all("Think about digits." not in trainer.tokenizer.decode(ids[0]) for ids in seen[1:])


@pytest.mark.parametrize(("options", "named"), [
    (["teacher.warm_start_prompts=2"], "teacher.model"),
    (["teacher.model=self", "teacher.system_prompt=x", "teacher.warm_start_prompts=-1"],
     "teacher.warm_start_prompts"),
    (["teacher.model=self", "teacher.system_prompt=x", "teacher.warm_start_prompts=2",
      "teacher.warm_start_steps=0"], "teacher.warm_start_steps"),
    (["teacher.model=self", "teacher.system_prompt=x", "teacher.warm_start_prompts=2",
      "launcher=ray"], "launcher=local"),
])
def test_a_warm_start_it_cannot_run_is_refused_by_name(tmp_path, options, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config(tmp_path, *options)


def test_a_teacher_for_the_warm_start_alone_needs_no_distill_coef(tmp_path):
    cfg = config(tmp_path, "teacher.model=self", "teacher.system_prompt=x",
                 "teacher.warm_start_prompts=2")
    assert cfg.teacher.warm_start_prompts == 2
    assert load_config(None, ["model=tiny", "teacher.model=self", "teacher.system_prompt=x",
                              "teacher.warm_start_prompts=2", "recipe=dr_grpo"]).teacher.model
