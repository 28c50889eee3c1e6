"""examples/findings: the experiment plan passes postrl's fairness checks, and the report
generator turns real (tiny-model) run directories into docs/findings.md with numbers that
equal those in the runs' files."""

import json
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from postrl.cli import main as postrl_main
from postrl.config import load_config
from postrl.errors import ConfigError, DataError
from postrl.experiments.stats import format_mean_ci, mean_ci95
from postrl.recipes import get_recipe

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "findings"))
import findings_plan  # noqa: E402
import write_report  # noqa: E402

REWARDS = REPO / "tests" / "train" / "rewards_for_tests.py"
# A random model never answers correctly: this reward varies within some groups and is
# constant in others, so dynamic sampling drops groups and generates extra rounds. Stopping at
# an "e" makes lengths (and so the per-step metrics) differ from step to step.
TINY = ("model=tiny", "group_size=4", "max_new_tokens=10", "stop=[e]", "eval_every=2",
        "eval_n=2", "quiet=true", f"rewards=[{REWARDS}:parity_on_odd_answers]")
BUDGET = 50  # a few steps of 2 prompts x 4 samples of ~2 tokens
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """Every experiment of the plan, run for real on the tiny model with 2 seeds."""
    root = tmp_path_factory.mktemp("findings") / "runs"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)  # the plan's config paths are relative to the repository
        patch.setattr(findings_plan, "launch", postrl_main)  # in-process: no interpreter start
        for experiment in findings_plan.EXPERIMENTS:
            small = replace(experiment, token_budget=BUDGET, seeds=2)
            assert findings_plan.run_one(small, root, overrides=TINY) > 0
    return root


@pytest.fixture(scope="module")
def doc(runs_root) -> Path:
    out = runs_root.parent / "docs" / "findings.md"
    write_report.write(runs_root, REPO / "examples" / "findings" / "notes.md", out)
    return out


def metrics(run_dir: Path) -> list[dict]:
    """The run's step records (the evaluation before training, step 0, left out)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if record["step"] > 0]


def table_rows(text: str, header_start: str) -> dict[str, list[str]]:
    """The Markdown table whose header row starts with ``header_start``: label -> cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def cell(values) -> str:
    return format_mean_ci(*mean_ci95(values))


def late_mean(records: list[dict], metric: str) -> float:
    tail = records[-max(1, len(records) // 3):]
    found = [r[metric] for r in tail if r.get(metric) is not None]
    return sum(found) / len(found)


# ---- the plan -----------------------------------------------------------------------------

@pytest.mark.parametrize("experiment", findings_plan.EXPERIMENTS, ids=lambda e: e.name)
def test_each_experiment_passes_the_fairness_checks_without_warnings(experiment, tmp_path,
                                                                     monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert postrl_main([*experiment.argv(tmp_path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
    # no inert component, and a token budget; what remains is the arms being several
    # components apart (brands, not one change: issue 44 re-plans these experiments), which
    # a ladder never is
    assert all(" components (" in w and "compare one change at a time" in w
               for w in warnings), warnings
    assert not warnings if experiment.name == "ladder" else warnings
    assert f"x {experiment.seeds} seeds" in printed and experiment.seeds >= 3
    assert f"stop at token budget {experiment.token_budget}" in printed
    assert "model smollm2-135m-instruct" in printed


@pytest.mark.parametrize("experiment", findings_plan.EXPERIMENTS, ids=lambda e: e.name)
def test_every_generated_response_is_logged(experiment):
    cfg = load_config(REPO / experiment.config)
    recipes = [get_recipe(r.partition(":")[0]) for r in experiment.recipes]
    rounds = max(r.max_sampling_rounds if r.dynamic_sampling else 1 for r in recipes)
    assert cfg.log_samples >= cfg.prompts_per_step * cfg.group_size * rounds


def test_offpolicy_takes_several_updates_per_batch_and_the_others_one():
    updates = {e.name: load_config(REPO / e.config).updates_per_batch
               for e in findings_plan.EXPERIMENTS}
    assert updates == {"length": 1, "ladder": 1, "offpolicy": 4}


def test_unknown_experiment_is_refused():
    with pytest.raises(SystemExit, match="unknown experiment.*nope.*length, ladder, offpolicy"):
        findings_plan.select(["nope"])


# ---- the report on real runs ----------------------------------------------------------------

def test_driver_records_command_and_wall_time(runs_root):
    for experiment in findings_plan.EXPERIMENTS:
        record = json.loads((runs_root / experiment.name / "findings.json").read_text())
        assert record["command"].startswith(f"postrl {experiment.command} ")
        assert f"--token-budget {BUDGET}" in record["command"]
        assert record["wall_seconds"] > 0


def test_doc_names_every_run_directory_and_links_existing_pngs(doc, runs_root):
    text = doc.read_text()
    for experiment in findings_plan.EXPERIMENTS:
        manifest = json.loads((runs_root / experiment.name / "comparison.json").read_text())
        for run in manifest["runs"]:
            assert f"`{runs_root / experiment.name / run['label'] / ('s' + str(run['seed']))}`" \
                in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) >= 3 * len(findings_plan.EXPERIMENTS)
    for link in links:
        assert (doc.parent / link).read_bytes().startswith(PNG_MAGIC)
    assert "{{" not in text and "}}" not in text


def test_overview_totals_equal_the_metrics_files(doc, runs_root):
    tokens = sum(metrics(path.parent)[-1]["rollout/tokens_generated"]
                 for path in runs_root.glob("*/*/s*/metrics.jsonl"))
    overview = table_rows(doc.read_text(), "| experiment |")
    assert overview["all"][3] == f"{tokens:,}"
    walls = [json.loads(p.read_text())["wall_seconds"] for p in runs_root.glob("*/findings.json")]
    assert overview["all"][4] == f"{sum(walls) / 60:.1f} min"


def test_length_table_equals_the_metrics_files(doc, runs_root):
    rows = table_rows(doc.read_text(), "|  | grpo (n=2) | dr_grpo (n=2) |")
    for column, recipe in enumerate(("grpo", "dr_grpo")):
        runs = [metrics(runs_root / "length" / recipe / f"s{seed}") for seed in (0, 1)]
        assert rows["length of incorrect answers, late"][column] == cell(
            late_mean(r, "length/incorrect_mean") for r in runs)
        assert rows["held-out greedy accuracy (last evaluation)"][column] == cell(
            [r for r in run if "eval/accuracy" in r][-1]["eval/accuracy"] for run in runs)


def test_ladder_counts_every_generated_response(doc, runs_root):
    text = doc.read_text()
    header = next(line for line in text.splitlines() if line.startswith("|  | grpo+clip_high"))
    labels = [h.strip().rsplit(" (n=", 1)[0] for h in header.strip("|").split("|")[1:]]
    rows = table_rows(text, header)
    assert labels[-1] == "dapo"
    for column, label in enumerate(labels):
        shares, per_1k = [], []
        for seed in (0, 1):
            run = runs_root / "ladder" / label / f"s{seed}"
            last = metrics(run)[-1]
            shares.append(last["rollout/tokens_wasted"] / last["rollout/tokens_generated"])
            samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
            assert len(samples) == last["rollout/responses"]  # every response, dropped too
            per_1k.append(1000 * sum(s["correct"] for s in samples)
                          / sum(s["length"] for s in samples))
        assert rows["wasted tokens (share of generated)"][column] == cell(shares)
        assert rows["correct answers per 1,000 generated tokens"][column] == cell(per_1k)
    assert rows["wasted tokens (share of generated)"][-1] != "0 ± 0"  # dynamic sampling dropped


def test_offpolicy_table_equals_the_metrics_files(doc, runs_root):
    rows = table_rows(doc.read_text(), "|  | grpo (n=2) | gspo (n=2) | dhpo (n=2) |")
    for column, recipe in enumerate(("grpo", "gspo", "dhpo")):
        runs = [metrics(runs_root / "offpolicy" / recipe / f"s{seed}") for seed in (0, 1)]
        spread = [sum(r["ratio/seq_std"] for r in run) / len(run) for run in runs]
        assert rows["std of sequence ratios s_i (mean over steps)"][column] == cell(spread)
        assert max(spread) > 0  # the later minibatches really are off-policy
        assert rows["gradient norm before clipping (run max)"][column] == cell(
            max(r["grad/norm"] for r in run) for run in runs)


def test_regeneration_keeps_the_prose_and_is_deterministic(runs_root, tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("Hand-written: GRPO's incorrect answers moved by "
                     "{{ length value grpo len_incorrect_change }} tokens.\n\n"
                     "{{ length table }}\n")
    out = tmp_path / "doc.md"
    write_report.write(runs_root, notes, out)
    first = out.read_text()
    write_report.write(runs_root, notes, out)
    assert out.read_text() == first
    rows = table_rows(first, "|  | grpo (n=2)")
    quoted = rows["length of incorrect answers, late - early"][0]
    assert f"Hand-written: GRPO's incorrect answers moved by {quoted} tokens." in first


# ---- clear errors -------------------------------------------------------------------------

def write_notes(tmp_path: Path, text: str) -> Path:
    notes = tmp_path / "notes.md"
    notes.write_text(text)
    return notes


def test_missing_experiment_names_the_file_and_the_command(tmp_path, runs_root):
    notes = write_notes(tmp_path, "{{ nothere table }}\n")
    with pytest.raises(DataError, match=r"nothere/comparison.json: missing; run `make findings`"):
        write_report.write(runs_root, notes, tmp_path / "doc.md")


@pytest.mark.parametrize("placeholder, message", [
    ("{{ length nonsense }}", r"notes.md:2: \{\{ length nonsense \}\}: expected"),
    ("{{ length value grpo nope }}", r"notes.md:2: .*no row 'nope' for length; rows: acc_late"),
    ("{{ length value ppo steps }}", r"notes.md:2: .*no recipe 'ppo' .*recipes: grpo, dr_grpo"),
])
def test_bad_placeholders_name_notes_line(tmp_path, runs_root, placeholder, message):
    notes = write_notes(tmp_path, f"prose\n{placeholder}\n")
    with pytest.raises(DataError, match=message):
        write_report.write(runs_root, notes, tmp_path / "doc.md")


def copy_experiment(runs_root: Path, name: str, tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    shutil.copytree(runs_root / name, root / name)
    return root


def test_experiment_without_a_view_gets_setup_but_no_table(tmp_path, runs_root):
    root = tmp_path / "runs"
    shutil.copytree(runs_root / "length", root / "mine")
    doc = tmp_path / "doc.md"
    write_report.write(root, write_notes(tmp_path, "{{ mine setup }}\n"), doc)
    assert "- `dr_grpo`: advantage: group-relative, no std scaling" in doc.read_text()
    with pytest.raises(DataError, match="no table or figures are defined for experiment 'mine'"):
        write_report.write(root, write_notes(tmp_path, "{{ mine table }}\n"), doc)


def test_incomplete_samples_are_refused(tmp_path, runs_root):
    root = copy_experiment(runs_root, "ladder", tmp_path)
    samples = root / "ladder" / "dapo" / "s0" / "samples.jsonl"
    samples.write_text("\n".join(samples.read_text().splitlines()[:-1]) + "\n")
    notes = write_notes(tmp_path, "{{ ladder table }}\n")
    with pytest.raises(DataError, match=r"dapo/s0/samples.jsonl: step \d+ logs \d+ of its \d+ "
                                        "responses; set log_samples"):
        write_report.write(root, notes, tmp_path / "doc.md")


def test_runs_that_differ_outside_the_recipe_are_refused(tmp_path, runs_root):
    root = copy_experiment(runs_root, "length", tmp_path)
    config_path = root / "length" / "dr_grpo" / "s1" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["lr"] = 1.0
    config_path.write_text(yaml.safe_dump(config))
    notes = write_notes(tmp_path, "{{ length table }}\n")
    unfair = "(?s)unfair comparison.*lr: 1e-05 in .* 1.0 in dr_grpo/s1"
    with pytest.raises(ConfigError, match=unfair):
        write_report.write(root, notes, tmp_path / "doc.md")


def test_cli_prints_the_error_without_a_traceback(tmp_path, capsys):
    code = write_report.main([str(tmp_path / "empty"), "--out", str(tmp_path / "doc.md")])
    assert code == 2
    assert "write_report: error:" in capsys.readouterr().err
