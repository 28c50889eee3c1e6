"""studies/findings: the pre-registered experiments pass postrl's fairness checks one component
apart, their analyses compute what the plan says, the driver resumes, and the report generator
turns real (tiny-model) runs into docs/findings.md with numbers equal to the runs' files."""

import importlib.util
import json
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from postrl.cli import main as postrl_main
from postrl.config import load_config
from studies.findings import analysis, findings_plan, write_report
from tests.test_interrupt import sigterm_after_two_steps

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "studies" / "findings" / "plan.md"
# the study's own tests: `make findings-check` runs them (CI does), `make test` does not
pytestmark = pytest.mark.findings

REWARDS = REPO / "tests" / "train" / "rewards_for_tests.py"
# A random model never answers correctly: this reward varies within some groups and is
# constant in others, so dynamic sampling drops groups and generates extra rounds. Stopping at
# an "e" makes lengths (and so the per-step metrics) differ from step to step.
TINY = ("model=tiny", "task=arithmetic", "task_options={}", "group_size=4", "max_new_tokens=10",
        "stop=[e]", "eval_n=2", "quiet=true", "save_every=1", "recipe_options.overlong_buffer=4",
        f"rewards=[{REWARDS}:parity_on_odd_answers]")
BUDGET = 60
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# E5v samples with vLLM: it runs here only where vLLM is installed (make findings-sampler-vllm)
RUNNABLE = [e for e in findings_plan.EXPERIMENTS if HAS_VLLM or not e.vllm]
# what an arm may change beside one component: a ratio unit brings its clip ranges; TIS needs
# the recomputed old policy; a field varied on purpose (the sampler) changes no component
ALLOWED = {"offpolicy": (["ratio", "clip"],),
           "sampler": ([], ["ratio", "clip"], ["mismatch correction", "old policy"]),
           "sampler-vllm": ([],)}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """Every experiment of the plan, run for real on the tiny model with 2 seeds."""
    root = tmp_path_factory.mktemp("findings") / "runs"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)  # the plan's config path is relative to the repository
        patch.setattr(findings_plan, "launch", postrl_main)  # in-process: no interpreter start
        for experiment in RUNNABLE:
            small = replace(experiment, token_budget=BUDGET, seeds=2)
            assert findings_plan.run_one(small, root, extra=TINY) > 0
    return root


# ---- the plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("experiment", RUNNABLE, ids=lambda e: e.name)
def test_arms_are_one_component_apart_and_fair(experiment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert postrl_main([*experiment.argv(tmp_path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    if experiment.name == "offpolicy":  # a ratio unit brings the clip ranges of its branch
        assert all("2 components (ratio, clip)" in w for w in warnings), warnings
    elif experiment.name == "staleness":  # a corrected arm is compared with its stale one
        assert len(warnings) == 2, warnings
        assert all("2 components (mismatch correction, staleness)" in w for w in warnings)
    elif experiment.name == "sampler":  # TIS recomputes pi_old; GSPO and DHPO as in E3
        assert len(warnings) == 3, warnings
        assert "2 components (mismatch correction, old policy)" in warnings[0]
        assert all("2 components (ratio, clip)" in w for w in warnings[1:])
        assert "sampler_precision=fp32: sampler_precision=fp32" in printed
    else:
        assert warnings == []
    assert f"x {experiment.seeds} seeds" in printed and experiment.seeds >= 5
    assert f"stop at token budget {experiment.token_budget}" in printed
    assert "model smollm2-135m-instruct" in printed
    assert sum(h.primary for h in experiment.hypotheses) == 1
    assert all(h.expected != 0 for h in experiment.hypotheses if h.primary)


@pytest.mark.parametrize("experiment", findings_plan.EXPERIMENTS, ids=lambda e: e.name)
def test_every_hypothesis_pairs_arms_one_component_apart(experiment, monkeypatch):
    from postrl.components import differing
    from postrl.experiments.compare import RECIPE_OPTIONS, arm_recipe

    monkeypatch.chdir(REPO)
    recipes = {}
    for arm in experiment.arms:  # the recipe alone: an arm's shared-config fields left out
        name, _, options = arm.partition(":")
        kept = [o for o in options.split(",") if o.split("=")[0] in RECIPE_OPTIONS]
        recipe = arm_recipe(":".join([name, ",".join(kept)]) if kept else name, "arm",
                            findings_plan.BASE)
        recipes[findings_plan.arm_label(arm)] = recipe
    allowed = ALLOWED.get(experiment.name, ())
    for h in experiment.hypotheses:
        changed = [c.title for c in differing(recipes[h.first], recipes[h.second])]
        assert len(changed) == 1 or changed in allowed, (h.first, h.second, changed)


def test_offpolicy_and_the_sampler_take_several_updates_per_batch():
    base = load_config(REPO / findings_plan.BASE)
    assert base.updates_per_batch == 1
    updates = {e.name: load_config(REPO / findings_plan.BASE,
                                   [o for o in e.overrides if "=" in o]).updates_per_batch
               for e in findings_plan.EXPERIMENTS}
    assert updates == {"length": 1, "dynamic": 1, "offpolicy": 4, "staleness": 1,
                       "sampler": 4, "sampler-vllm": 4}


def test_evaluation_runs_at_the_start_and_the_end_only():
    base = load_config(REPO / findings_plan.BASE)
    assert base.eval_every >= 1000 and base.eval_samples >= 4


def test_unknown_experiment_is_refused():
    with pytest.raises(SystemExit, match="unknown experiment.*nope.*length, dynamic, offpolicy"):
        findings_plan.select(["nope"])


# ---- the analyses -----------------------------------------------------------------------------

def _records(lengths, tokens, evals=(0.25, 0.5)):
    rows = [{"step": 0, "rollout/tokens_generated": 0, "eval/sampled_accuracy": evals[0]}]
    for step, (length, total) in enumerate(zip(lengths, tokens, strict=True), 1):
        rows.append({"step": step, "rollout/tokens_generated": total,
                     "length/incorrect_mean": length, "grad/norm": float(step)})
    rows[-1]["eval/sampled_accuracy"] = evals[1]
    return rows


def test_incorrect_length_slope_is_per_thousand_generated_tokens():
    rows = _records([10.0, 12.0, None, 16.0], [1000, 2000, 3000, 4000])
    expected = scipy_stats.linregress([1, 2, 4], [10, 12, 16]).slope
    assert analysis.incorrect_length_slope(rows) == pytest.approx(expected) == pytest.approx(2)
    assert analysis.incorrect_length_slope(rows[:3]) is None  # two points are not a trend


def test_heldout_gain_per_step_and_spikes():
    rows = _records([10.0, 11.0, 12.0, 13.0], [100, 200, 300, 400])
    assert analysis.heldout_gain_per_step(rows) == pytest.approx(0.25 / 4)
    assert analysis.heldout_final(rows) == 0.5
    assert analysis.grad_norm_spikiness(rows) == pytest.approx(4 / 2.5)
    assert analysis.heldout_gain_per_step(rows[1:]) is None  # no evaluation before training


def test_ratio_warnings_count_the_kinds_diagnose_reports():
    rows = _records((10, 12), (100, 200))
    assert analysis.ratio_warnings(rows) == 0
    rows[1]["ratio/max"] = 7.0  # heavy tail
    rows[2]["ratio/max"] = 9.0  # the same kind again: still one warning
    rows[2]["ratio/token_logratio_std"] = 0.3  # log-ratio spread
    assert analysis.ratio_warnings(rows) == 2
    assert analysis.ratio_warnings(rows[:1]) is None  # no step


def _sampler_outcomes(finals: dict[int, float]) -> list:
    """E5's hypotheses tested on runs whose held-out pass@1 ends at ``finals[arm index]``
    (plus a small per-seed wobble)."""
    runs = {}
    for index, arm in enumerate(findings_plan.SAMPLER_ARMS):
        runs[findings_plan.arm_label(arm)] = {
            seed: [{"step": 0, "eval/sampled_accuracy": 0.5},
                   {"step": 1, "eval/sampled_accuracy": finals[index] + 0.01 * (seed % 3)}]
            for seed in range(6)}
    return [analysis.test(h, runs) for h in findings_plan.BY_NAME["sampler"].hypotheses]


def test_e5s_reading_follows_the_rule_fixed_in_the_plan():
    reading = findings_plan.sampler_reading
    # the gap costs accuracy (A below A0) and GSPO recovers it
    said = reading(_sampler_outcomes({0: 0.6, 1: 0.8, 2: 0.6, 3: 0.8, 4: 0.6}))
    gspo = findings_plan.arm_label(findings_plan.SAMPLER_ARMS[3])
    assert said.startswith("sequence-level correction addresses") and f"`{gspo}`" in said
    # the gap costs accuracy; only TIS recovers it
    said = reading(_sampler_outcomes({0: 0.6, 1: 0.8, 2: 0.8, 3: 0.6, 4: 0.5}))
    assert said.startswith("the gap cost held-out accuracy, but neither")
    # no cost resolved: GSPO's gain is a difference in its own right
    said = reading(_sampler_outcomes({0: 0.8, 1: 0.8, 2: 0.8, 3: 0.9, 4: 0.8}))
    assert said.startswith("no cost of the bf16 sampler's gap was resolved")


def test_verdicts_follow_the_preregistered_rule():
    rising = {s: _records([10 + s, 20 + s, 30 + s], [1000, 2000, 3000]) for s in range(5)}
    flat = {s: _records([10 + s, 10 + s, 10.5 + s], [1000, 2000, 3000]) for s in range(5)}
    shifted = {s: _records([10, 10, 10 - s], [1000, 2000, 3000]) for s in range(5)}
    noisy = {s: _records([10, 10, 10 + k], [1000, 2000, 3000])
             for s, k in enumerate((25, -5, 30, -10, 15))}  # slopes 12.5, -2.5, 15, -5, 7.5
    runs = {"a": rising, "b": flat, "c": shifted, "d": noisy}
    lower = analysis.Hypothesis("a", "b", analysis.incorrect_length_slope, -1, True)
    outcome = analysis.test(lower, runs)
    assert outcome.verdict.startswith("reproduced (lower")
    assert outcome.tested.alternative == "less" and outcome.tested.high < 0
    higher = analysis.Hypothesis("a", "b", analysis.incorrect_length_slope, +1, True)
    assert analysis.test(higher, runs).verdict.startswith("opposite (lower")
    undirected = analysis.Hypothesis("a", "c", analysis.incorrect_length_slope, 0, False)
    assert analysis.test(undirected, runs).verdict.startswith("differs (lower")
    unresolved = analysis.test(analysis.Hypothesis("a", "d", analysis.incorrect_length_slope,
                                                   -1, True), runs)
    assert unresolved.verdict == (
        f"not resolved (minimum detectable effect {unresolved.tested.mde:.3g})")


def test_a_secondary_is_described_two_sided_whatever_was_expected():
    fewer = {s: _records([10.0] * 3, [100, 200, 300]) for s in range(5)}
    more = {s: _records([10.0] * (4 + s % 2), [100] * (4 + s % 2)) for s in range(5)}
    runs = {"a": more, "b": fewer}
    secondary = analysis.Hypothesis("a", "b", analysis.steps_taken, -1, False)
    outcome = analysis.test(secondary, runs)
    assert outcome.tested.alternative == "two-sided" and outcome.tested is outcome.two_sided
    assert outcome.verdict == ("differs (lower; lower was expected; the two-sided interval "
                               "excludes 0)")
    assert "reproduced" not in outcome.verdict
    primary = analysis.test(analysis.Hypothesis("a", "b", analysis.steps_taken, -1, True), runs)
    assert primary.verdict.startswith("reproduced (lower")
    assert primary.tested.alternative == "less"


def test_per_step_note_separates_the_step_count_from_the_gain():
    def run(steps, gain):
        return _records([10.0] * steps, [100 * k for k in range(1, steps + 1)], (0.25, 0.25 + gain))

    # The second arm gains exactly as much in total, in half the steps.
    arms = {"a": {s: run(10, 0.1 + s / 100) for s in range(5)},
            "b": {s: run(5, 0.1 + s / 100) for s in range(5)}}
    text = "\n".join(write_report.per_step_note("a", "b", arms))
    row = next(line for line in text.splitlines() if line.startswith("| 0 |"))
    assert row == "| 0 | 10 | 5 | 0.1 | 0.1 | 0.01 | 0.01 |"  # observed = predicted
    assert "no difference in total gain is resolved" in text
    assert "predicted by the step counts alone 0.012" in text
    assert "not pre-registered" in text


# ---- the driver and the report on real runs ---------------------------------------------------

def test_driver_records_command_wall_time_and_prunes_checkpoints_and_weights(runs_root):
    for experiment in RUNNABLE:
        record = json.loads((runs_root / experiment.name / "findings.json").read_text())
        assert record["command"].startswith("postrl compare ")
        assert "--resume" in record["command"] and f"--token-budget {BUDGET}" in record["command"]
        assert record["wall_seconds"] > 0
        finals = list((runs_root / experiment.name).glob("*/s*/final"))
        assert len(finals) == 2 * len(experiment.arms)
        assert not any((f.parent / "checkpoints").exists() for f in finals)
        assert all((f / "config.json").is_file() for f in finals)  # finished, for --resume
        assert not any(list(f.glob("*.safetensors")) for f in finals)


def test_driver_records_each_runs_commit_and_keeps_only_light_files(runs_root, tmp_path):
    commit = findings_plan.git_commit()
    assert commit.split("+")[0] != "unknown"
    kept = tmp_path / "results"
    for experiment in RUNNABLE:
        small = replace(experiment, seeds=2)
        record = json.loads((runs_root / experiment.name / "findings.json").read_text())
        assert record["commits"] == dict.fromkeys(findings_plan.run_names(small), commit)
        findings_plan.keep(runs_root / experiment.name, kept / experiment.name,
                           findings_plan.run_names(small))
    files = sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file())
    assert {Path(f).name for f in files} == {"comparison.json", "findings.json", "config.yaml",
                                             "metrics.jsonl"}
    experiments = RUNNABLE
    assert len(files) == 2 * len(experiments) + 2 * 2 * sum(len(e.arms) for e in experiments)
    assert sum(p.stat().st_size for p in kept.rglob("*") if p.is_file()) < 2_000_000
    # The page written from the kept files alone equals the one written from the runs.
    from_runs = write_report.write(runs_root, PLAN, tmp_path / "a" / "findings.md",
                                   tmp_path / "a" / "reports").read_text()
    from_kept = write_report.write(kept, PLAN, tmp_path / "b" / "findings.md",
                                   tmp_path / "b" / "reports").read_text()
    named = from_runs.replace(write_report.shown(runs_root), "ROOT")
    # The recorded command names the runs' directory (--out); the rest is the same.
    kept_named = from_kept.replace(write_report.shown(kept), "ROOT").replace(str(runs_root), "ROOT")
    assert named == kept_named
    assert "All 6 runs ran at commit" in from_kept


def test_an_interrupted_part_records_the_runs_it_finished_and_its_time(tmp_path, monkeypatch):
    experiment = replace(findings_plan.BY_NAME["dynamic"], seeds=2)
    runs = findings_plan.run_names(experiment)
    out = tmp_path / experiment.name

    def finishing(names, code):  # a launch that finishes ``names`` and exits with ``code``
        def launch(argv):
            for name in names:
                (out / name / "final").mkdir(parents=True)
                (out / name / "final" / "config.json").write_text("{}")
            return code
        return launch

    commits = iter(["aaa", "bbb", "ccc", "ccc"])  # the checkout moved during the first session
    monkeypatch.setattr(findings_plan, "git_commit", lambda: next(commits))
    monkeypatch.setattr(findings_plan, "launch", finishing(runs[:2], 130))
    with pytest.raises(SystemExit, match="run the same command again"):
        findings_plan.run_one(experiment, tmp_path)
    record = json.loads((out / "findings.json").read_text())
    assert record["commits"] == dict.fromkeys(runs[:2], "aaa..bbb")
    first = record["wall_seconds"]
    monkeypatch.setattr(findings_plan, "launch", finishing(runs[2:], 0))
    findings_plan.run_one(experiment, tmp_path)
    record = json.loads((out / "findings.json").read_text())
    assert record["commits"] == {**dict.fromkeys(runs[:2], "aaa..bbb"),
                                 **dict.fromkeys(runs[2:], "ccc")}
    assert list(record["commits"]) == runs and record["wall_seconds"] >= first


def test_a_sigterm_to_the_driver_stops_its_child_which_saves_first(tmp_path, capfd):
    """The driver passes SIGTERM on to its ``postrl`` process and outlives it, so the run
    says what it saved and the driver can record what finished (not left running unseen)."""
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    killer = sigterm_after_two_steps(run)
    code = findings_plan.launch(["train", "--model", "tiny", "--steps", "10000", "--out",
                                 str(run), "prompts_per_step=1", "group_size=2",
                                 "max_new_tokens=4", "save_every=1", "quiet=true"])
    killer.join()
    assert code == 128 + signal.SIGTERM
    assert "postrl: interrupted (SIGTERM); " in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert sorted((run / "checkpoints").glob("step_*"))  # the child saved before it stopped


def test_rerunning_a_finished_part_keeps_every_run(runs_root, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(findings_plan, "launch", postrl_main)
    experiment = replace(findings_plan.BY_NAME["dynamic"], token_budget=BUDGET, seeds=2)
    metrics = sorted((runs_root / "dynamic").glob("*/s*/metrics.jsonl"))
    before = [m.read_bytes() for m in metrics]
    findings_plan.run_one(experiment, runs_root, extra=TINY)
    assert capsys.readouterr().out.count("(finished: kept)") == 4
    assert [m.read_bytes() for m in metrics] == before


def test_report_numbers_equal_the_metrics_files(runs_root, tmp_path):
    out = tmp_path / "docs" / "findings.md"
    write_report.write(runs_root, PLAN, out, tmp_path / "studies" / "findings" / "reports")
    text = out.read_text()
    assert text.index("## Plan") < text.index("## Results") < text.index("### Verdicts")
    arms = write_report.load_arms(runs_root / "length")
    hypothesis = findings_plan.BY_NAME["length"].hypotheses[0]
    slopes = [analysis.incorrect_length_slope(arms[hypothesis.first][s]) for s in (0, 1)]
    row = next(line for line in text.splitlines()
               if line.startswith("| Slope of the mean incorrect-response length"))
    cell = ", ".join("–" if v is None else f"{v:.3g}" for v in slopes)
    assert f"| {cell} |" in row
    assert (tmp_path / "studies" / "findings" / "reports" / "length" / "report.md").is_file()
    verdicts = text[text.index("### Verdicts"):]
    assert "| E3 | GSPO clips far more tokens than GRPO | primary |" in verdicts
    assert "| E3 | yet trains stably" in verdicts  # the stability claim, apart from clipping
    assert verdicts.count("| primary |") == len(RUNNABLE)
    assert text.count("Not run yet") == len(findings_plan.EXPERIMENTS) - len(RUNNABLE)
    assert "**Reading** (the rule the plan fixed before the runs): " in text  # E5's
    described = text[text.index("**Described**"):].splitlines()[4]  # E5's TIS arm, alone
    tis = findings_plan.arm_label(findings_plan.SAMPLER_ARMS[2])
    values = [analysis.mean_over_steps("mismatch/kl_k3")(r)
              for r in write_report.load_arms(runs_root / "sampler")[tis].values()]
    assert described.startswith(f"| `{tis}` | Mean of mismatch/kl_k3 over the run's steps. | ")
    assert ", ".join(f"{v:.3g}" for v in values) in described
    assert "Reading the primary" in text  # E2's per-step artefact, beside its verdict
    hours = sum(json.loads((runs_root / e.name / "findings.json").read_text())["wall_seconds"]
                for e in RUNNABLE) / 3600
    assert f"{hours:.1f} hours in all" in text.splitlines()[-1]


def test_an_experiment_not_run_is_listed(tmp_path):
    (tmp_path / "runs").mkdir()
    out = write_report.write(tmp_path / "runs", PLAN, tmp_path / "findings.md",
                             tmp_path / "reports")
    assert (out.read_text().count("Not run yet: `make findings-")
            == len(findings_plan.EXPERIMENTS) == 6)


def test_the_page_in_git_regenerates_byte_for_byte(tmp_path):
    """docs/findings.md is what write_report.py makes from the plan and the runs' files kept
    in git alone (make findings-report): no number on it comes from elsewhere."""
    # the page and the reports in the repository's layout, so the links are the page's
    out = write_report.write(REPO / "studies" / "findings" / "results", PLAN,
                             tmp_path / "docs" / "findings.md",
                             tmp_path / "studies" / "findings" / "reports")
    assert out.read_text(encoding="utf-8") == (REPO / "docs" / "findings.md").read_text(
        encoding="utf-8"), "docs/findings.md is stale: run make findings-report"
