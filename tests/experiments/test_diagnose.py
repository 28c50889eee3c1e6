"""`diagnose` finds each pathology planted in a synthetic metric log, and none in a healthy one."""

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from postrl.errors import DataError
from postrl.experiments.diagnose import add_diagnose_arguments, diagnose, run_diagnose
from postrl.recipes import get_recipe

STEPS = 20


def healthy_rows(steps: int = STEPS) -> list[dict]:
    """A run that learns: reward rises, lengths and entropy steady, ratios tame."""
    rows = []
    for i in range(steps):
        rows.append({
            "step": i + 1, "rollout/tokens_generated": 1000 * (i + 1), "rollout/tokens_wasted": 0,
            "reward/mean": 0.3 + 0.02 * i, "accuracy/mean": 0.3 + 0.02 * i,
            "batch/zero_variance_frac": 0.1 + 0.01 * (i % 3), "grad/norm": 0.5,
            "length/mean": 60.0 + (i % 2), "length/correct_mean": 55.0 + (i % 3),
            "length/incorrect_mean": 65.0 - (i % 2), "length/truncated_frac": 0.02,
            "entropy/mean": 2.0 - 0.02 * i, "clip/low_frac": 0.01, "clip/high_frac": 0.012,
            "ratio/max": 1.3, "ratio/seq_std": 0.01, "ratio/token_logratio_std": 0.05,
            "kl/mean": 0.001 * i, "mismatch/kl_k3": 2e-5, "mismatch/ess": 0.99,
            "time/generate_s": 1.0, "time/score_s": 0.1,
            "time/reference_s": 0.2, "time/train_s": 0.5, "time/step_s": 1.8,
        })
    return rows


def write_run(path: Path, rows: list[dict], recipe: str = "grpo", seed: int = 0,
              **recipe_overrides) -> Path:
    """A run directory as `postrl train` leaves it: config.yaml (with resolved_recipe), metrics."""
    path.mkdir(parents=True)
    resolved = dataclasses.asdict(get_recipe(recipe).with_(**recipe_overrides))
    config = {"recipe": recipe, "seed": seed, "resolved_recipe": resolved}
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def planted(change) -> list[dict]:
    """The healthy rows with ``change(step_index, row)`` applied to each."""
    rows = healthy_rows()
    for index, row in enumerate(rows):
        change(index, row)
    return rows


def _zero_variance(i, row):
    row["batch/zero_variance_frac"] = 0.8


def _incorrect_grow(i, row):
    row["length/incorrect_mean"] = 60.0 + 6.0 * i


def _ratio_tail(i, row):
    row["ratio/max"] = 12.0 if i in (10, 11) else 1.3


def _clip_spike(i, row):
    row["clip/high_frac"] = 0.3 if i in (7, 8) else 0.012


def _logratio_spread(i, row):
    row["ratio/token_logratio_std"] = 0.5 if i >= 15 else 0.05


def _entropy_collapse(i, row):
    row["entropy/mean"] = 2.0 * 0.8 ** i


def _truncation(i, row):
    row["length/truncated_frac"] = 0.5


def _dead(i, row):
    row.update({"reward/mean": 0.0, "accuracy/mean": 0.0, "batch/zero_variance_frac": 1.0,
                "grad/norm": 0.0})


def _masked(i, row):
    row.update({"reward/mean": 0.4, "grad/norm": 0.0})


def _mismatch(i, row):
    row["mismatch/kl_k3"] = 4e-3 if i in (12, 13, 14) else 2e-5
    row["mismatch/ess"] = 0.7 if i == 15 else 0.99


@pytest.mark.parametrize(("change", "expected", "steps"), [
    (_zero_variance, {"zero_variance"}, (1, STEPS)),
    (_incorrect_grow, {"length_drift"}, (1, STEPS)),
    (_ratio_tail, {"ratio_heavy_tail"}, (11, 12)),
    (_clip_spike, {"clip_spike"}, (8, 9)),
    (_logratio_spread, {"logratio_spread"}, (16, STEPS)),
    # start = mean of the first 5 values = 1.345; 2 * 0.8**8 = 0.336 <= 1.345 / 4 at step 9
    (_entropy_collapse, {"entropy_collapse"}, (1, 9)),
    (_truncation, {"truncation"}, (1, STEPS)),
    (_dead, {"flat_reward", "zero_variance"}, (1, STEPS)),
    (_masked, {"flat_reward"}, (1, STEPS)),
    (_mismatch, {"sampler_mismatch"}, (13, 16)),
])
def test_each_planted_pathology_is_found(tmp_path, change, expected, steps):
    findings = diagnose(write_run(tmp_path / "run", planted(change)))
    assert {f.kind for f in findings} == expected
    first = findings[0]
    assert first.steps == steps and first.metric and first.message and first.advice


def test_a_healthy_run_has_no_findings(tmp_path):
    assert diagnose(write_run(tmp_path / "run", healthy_rows())) == []


def test_length_drift_advice_depends_on_the_normalisers(tmp_path):
    rows = planted(_incorrect_grow)
    [grpo] = diagnose(write_run(tmp_path / "grpo", rows, "grpo"))
    assert grpo.severity == "warning" and "Dr. GRPO" in grpo.advice
    assert "aggregation=seq_mean_token_mean" in grpo.message
    [dr] = diagnose(write_run(tmp_path / "dr", rows, "dr_grpo"))
    assert dr.severity == "info" and "ruled out" in dr.advice


def test_advice_follows_the_recipe(tmp_path):
    [spread] = diagnose(write_run(tmp_path / "tok", planted(_logratio_spread), "grpo"))
    assert "GSPO" in spread.advice and spread.value == pytest.approx(0.5)
    [seq] = diagnose(write_run(tmp_path / "seq", planted(_logratio_spread), "gspo"))
    assert "already corrects at sequence level" in seq.advice
    [entropy] = diagnose(write_run(tmp_path / "dapo", planted(_entropy_collapse), "dapo"))
    assert "already on" in entropy.advice
    [entropy] = diagnose(write_run(tmp_path / "grpo", planted(_entropy_collapse), "grpo"))
    assert "clip-higher" in entropy.advice
    [zero_var] = diagnose(write_run(tmp_path / "zv", planted(_zero_variance)))
    assert "dynamic sampling" in zero_var.advice and "too hard" in zero_var.advice


def test_mismatch_advice_depends_on_the_correction(tmp_path):
    [off] = diagnose(write_run(tmp_path / "off", planted(_mismatch)))
    assert "mismatch_weight=token" in off.advice and off.value == pytest.approx(4e-3)
    rows = planted(_mismatch)
    for row in rows:
        row["mismatch/truncated_frac"] = 0.02
    [on] = diagnose(write_run(tmp_path / "on", rows, mismatch_weight="token"))
    assert "the correction is on (token, truncate; 2.0% of tokens truncated" in on.advice


def test_flat_reward_explains_why(tmp_path):
    dead = diagnose(write_run(tmp_path / "dead", planted(_dead)))
    flat = next(f for f in dead if f.kind == "flat_reward")
    assert flat.severity == "error" and "no response was ever correct" in flat.message
    [masked] = diagnose(write_run(tmp_path / "masked", planted(_masked)))
    assert "masked" in masked.message


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_diagnose_arguments(parser)
    return parser.parse_args(argv)


def test_cli_text_and_json(tmp_path, capsys):
    run = write_run(tmp_path / "run", planted(_truncation))
    assert run_diagnose(_parse([str(run)])) == 0
    text = capsys.readouterr().out
    assert "[warning] truncation: length/truncated_frac = 0.5 (steps 1-20)" in text
    assert "advice:" in text
    assert run_diagnose(_parse([str(run), "--json"])) == 0
    [finding] = json.loads(capsys.readouterr().out)
    assert finding["kind"] == "truncation" and finding["steps"] == [1, STEPS]
    healthy = write_run(tmp_path / "ok", healthy_rows())
    assert run_diagnose(_parse([str(healthy)])) == 0
    assert "no findings" in capsys.readouterr().out


def test_unreadable_runs_raise_data_error_naming_the_file(tmp_path):
    (tmp_path / "nometrics").mkdir()
    with pytest.raises(DataError, match="nometrics/metrics.jsonl"):
        diagnose(tmp_path / "nometrics")
    empty = write_run(tmp_path / "empty", [])
    with pytest.raises(DataError, match="empty/metrics.jsonl: empty"):
        diagnose(empty)
