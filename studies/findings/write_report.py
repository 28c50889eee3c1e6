"""docs/findings.md from the pre-registered plan (``plan.md``, copied verbatim) and the runs.

    python -m studies.findings.write_report studies/findings/results --out docs/findings.md

It reads only the files ``findings_plan.py`` keeps in git (``studies/findings/results``:
each run's config.yaml and metrics.jsonl, each part's comparison.json and findings.json), so
a fresh clone regenerates the page byte for byte (``make findings-check``).

For each experiment of ``findings_plan.py`` that has run, the results section gives every
hypothesis's per-seed values, the paired difference (a primary's one-sided in the predicted
direction, a secondary's two-sided), its p-value and minimum detectable effect, and the
verdict; then the cost (steps, tokens, wall time), the commit each run ran at, and ``postrl
report``'s tables and curves in ``studies/findings/reports/<experiment>/``. An experiment that
has not run is listed as such, never skipped silently.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from postrl.errors import DataError
from postrl.experiments.report import load_run, write_report
from postrl.experiments.stats import (
    format_interval,
    format_number,
    mean_interval,
    paired_difference,
)
from studies.findings.analysis import (
    Outcome,
    Records,
    describe,
    heldout_gain,
    heldout_gain_per_step,
    steps_taken,
    test,
)
from studies.findings.findings_plan import EXPERIMENTS, RUN_RECORD, Experiment, arm_label

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def shown(path: Path) -> str:
    """``path`` as the page names it: relative to the repository when inside it, so the page
    does not depend on where the clone lives."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return path.as_posix()


def load_arms(root: Path) -> dict[str, dict[int, list[dict]]]:
    """Label -> seed -> records of one experiment's runs, as compare's comparison.json lists
    them (the labels the hypotheses name)."""
    manifest = root / "comparison.json"
    if not manifest.is_file():
        raise DataError(f"{manifest}: missing (written by postrl compare)")
    arms: dict[str, dict[int, list[dict]]] = {}
    for run in json.loads(manifest.read_text())["runs"]:
        path = root / run["label"] / f"s{run['seed']}"
        arms.setdefault(run["label"], {})[int(run["seed"])] = load_run(path).records
    return arms


def _values(values: dict[int, float | None]) -> str:
    return ", ".join("–" if v is None else format_number(v) for _, v in sorted(values.items()))


def outcome_row(outcome: Outcome) -> list[str]:
    h, d = outcome.hypothesis, outcome.tested
    arms = f"`{h.second}` − `{h.first}`"
    if d is None:
        return [describe(h.measure), arms, _values(outcome.first), _values(outcome.second),
                "–", "–", "–", outcome.verdict]
    interval = f"{format_number(d.mean)} [{format_number(d.low)}, {format_number(d.high)}]"
    return [describe(h.measure), arms, _values(outcome.first), _values(outcome.second), interval,
            f"{d.p_value:.3g} ({d.alternative})", format_number(d.mde), outcome.verdict]


HEADERS = ["measure", "arms", "first arm, per seed", "second arm, per seed",
           "difference [95% CI]", "p", "MDE (80%)", "verdict"]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def commits_line(record: dict, runs: int) -> list[str]:
    """Which commit finished each run, from findings.json."""
    commits: dict[str, str] = record.get("commits", {})
    if not commits:
        return ["The commit each run ran at was not recorded.", ""]
    by_commit: dict[str, list[str]] = {}
    for run, commit in commits.items():
        by_commit.setdefault(commit, []).append(run)
    if len(by_commit) == 1 and len(commits) == runs:
        return [f"All {runs} runs ran at commit `{next(iter(by_commit))}`.", ""]
    parts = [f"`{commit}`: " + ", ".join(f"`{r}`" for r in names)
             for commit, names in by_commit.items()]
    missing = runs - len(commits)
    return ["The commit that finished each run: " + "; ".join(parts)
            + (f"; {missing} not recorded" if missing else "") + ".", ""]


def per_step_note(first: str, second: str, arms: dict[str, dict[int, Records]]) -> list[str]:
    """What a per-step primary holds when the arms take different numbers of steps: each
    seed's steps and total held-out gain, and the per-step difference the step counts alone
    predict (the first arm's gain spread over the second arm's steps)."""
    a, b = arms[first], arms[second]
    seeds = sorted(set(a) & set(b))
    rows, observed, predicted = [], [], []
    for seed in seeds:
        steps_a, steps_b = steps_taken(a[seed]), steps_taken(b[seed])
        gain_a, gain_b = heldout_gain(a[seed]), heldout_gain(b[seed])
        if None in (steps_a, steps_b, gain_a, gain_b):
            rows.append([str(seed)] + ["–"] * 6)
            continue
        observed.append(gain_b / steps_b - gain_a / steps_a)
        predicted.append(gain_a / steps_b - gain_a / steps_a)
        rows.append([str(seed), f"{steps_a:.0f}", f"{steps_b:.0f}", format_number(gain_a),
                     format_number(gain_b), format_number(observed[-1]),
                     format_number(predicted[-1])])
    total = paired_difference({s: heldout_gain(a[s]) for s in seeds},
                              {s: heldout_gain(b[s]) for s in seeds})
    lines = ["", "**Reading the primary** (added after the runs, at a referee's request; not "
             "pre-registered). The primary divides each run's held-out gain by its optimizer "
             f"steps, and within one token budget `{second}` and `{first}` take different "
             "numbers of steps, so the per-step gains differ even where the total gains do "
             "not. The last column is the difference the step counts alone predict: the "
             "first arm's total gain divided by the second arm's steps, minus its own gain "
             "per step.", ""]
    lines += table(["seed", "steps, first", "steps, second", "total gain, first",
                    "total gain, second", "per-step difference", "predicted by the steps"], rows)
    if total is None or not observed:
        return lines + ["", "Too few paired seeds to compare the total gains."]
    interval = (f"{format_number(total.mean)} [{format_number(total.low)}, "
                f"{format_number(total.high)}], p {total.p_value:.3g} (two-sided)")
    if total.excludes_zero:
        said = ("the total gains differ too (" + ("higher" if total.mean > 0 else "lower")
                + " in the second arm)")
    else:
        power = (f" (minimum detectable effect {format_number(total.mde)})"
                 if math.isfinite(total.mde) else "")
        said = (f"no difference in total gain is resolved{power}, so the per-step primary "
                "cannot be read as more learning at equal cost")
    mean = sum(observed) / len(observed), sum(predicted) / len(predicted)
    return lines + ["", f"Total held-out gain, second arm minus first, paired by seed: "
                        f"{interval}: {said}. Mean per-step difference observed "
                        f"{format_number(mean[0])}; predicted by the step counts alone "
                        f"{format_number(mean[1])}."]


def described_table(experiment: Experiment, arms: dict[str, dict[int, Records]]) -> list[str]:
    """The measures the plan describes for one arm alone, per seed and as a mean."""
    rows = []
    for index, measure in experiment.described:
        label = arm_label(experiment.arms[index])
        values = {seed: measure(records) for seed, records in arms[label].items()}
        rows.append([f"`{label}`", describe(measure), _values(values),
                     format_interval(mean_interval(values.values()))])
    if not rows:
        return []
    return ["", "**Described** (one arm's values, as the plan says):", "",
            *table(["arm", "measure", "per seed", "mean [95% CI]"], rows)]


def results_section(experiment: Experiment, root: Path, figures: Path,
                    page: Path) -> tuple[list[str], list[list[str]]]:
    """The Markdown of one experiment's results, and its rows of the verdict table (the
    primary, and each secondary that speaks to a part of the paper's claim); ``postrl
    report``'s pages go to ``figures``, linked from the page at ``page``."""
    title = f"### {experiment.title}"
    if not (root / RUN_RECORD).is_file():
        return [title, "", f"Not run yet: `make findings-{experiment.name}`.", ""], []
    arms = load_arms(root)
    outcomes = [test(h, arms) for h in experiment.hypotheses]
    record = json.loads((root / RUN_RECORD).read_text())
    lines = [title, "", f"Command: `{record['command']}`; wall time "
             f"{record['wall_seconds'] / 60:.1f} min. Files: `{shown(root)}/<arm>/s<seed>/` "
             "(config.yaml, metrics.jsonl).", ""]
    lines += commits_line(record, sum(len(seeds) for seeds in arms.values()))
    if record.get("note"):  # how the runs came about, where that is not the command alone
        lines += [f"*Provenance.* {record['note']}", ""]
    primary = [o for o in outcomes if o.hypothesis.primary]
    rows = [outcome_row(o) for o in primary]
    lines += ["**Primary** (pre-registered):", ""] + table(HEADERS, rows)
    for outcome in primary:
        if outcome.hypothesis.measure is heldout_gain_per_step:
            lines += per_step_note(outcome.hypothesis.first, outcome.hypothesis.second, arms)
    secondary = [outcome_row(o) for o in outcomes if not o.hypothesis.primary]
    lines += ["", "**Secondary** (two-sided and described, as the plan says; not tested for "
              "the claim):", ""]
    lines += table(HEADERS, secondary)
    lines += described_table(experiment, arms)
    if experiment.reading is not None:
        lines += ["", f"**Reading** (the rule the plan fixed before the runs): "
                      f"{experiment.reading(outcomes)}"]
    if any("–" in cell for row in rows + secondary for cell in row):
        lines += ["", "–: no value, and the seed is left out of that pair (e.g. the "
                  "gradient-norm ratio of a run whose median gradient norm is 0: most of its "
                  "steps had no group with a spread of rewards)."]
    cost = [[label, format_interval(mean_interval(steps_taken(r) for r in seeds.values())),
             format_interval(mean_interval(_last(r, "rollout/tokens_generated")
                                           for r in seeds.values())),
             format_interval(mean_interval(_last(r, "rollout/tokens_wasted") or 0
                                           for r in seeds.values()))]
            for label, seeds in arms.items()]
    lines += ["", "**Cost** per run, mean over seeds [95% CI]:", ""]
    lines += table(["arm", "optimizer steps", "tokens generated", "of them wasted"], cost)
    report_html, report_md = write_report([root], figures)
    link = Path(os.path.relpath(report_md, page.parent)).as_posix()
    lines += ["", f"Every summary metric paired by seed, and the curves: [{link}]({link}).", ""]
    verdicts = [[experiment.title.split()[0], o.hypothesis.claim or describe(o.hypothesis.measure),
                 "primary" if o.hypothesis.primary else "secondary", o.verdict]
                for o in outcomes if o.hypothesis.primary or o.hypothesis.claim]
    return lines, verdicts


def _last(records: Records, metric: str) -> float | None:
    return records[-1].get(metric) if records else None


def time_line(runs_root: Path) -> list[str]:
    """What ``make findings`` took: each part's recorded wall time, and their sum."""
    parts = []
    for experiment in EXPERIMENTS:
        record = runs_root / experiment.name / RUN_RECORD
        if record.is_file():
            minutes = json.loads(record.read_text())["wall_seconds"] / 60
            parts.append((experiment.title.split()[0], minutes))
    if not parts:
        return []
    each = ", ".join(f"{name} {minutes:.0f} min" for name, minutes in parts)
    missing = len(EXPERIMENTS) - len(parts)
    rest = f"; {missing} part(s) not run yet" if missing else ""
    return [f"**Time.** The parts' wall times, as recorded: {each}; "
            f"{sum(m for _, m in parts) / 60:.1f} hours in all{rest}."]


def write(runs_root: Path, plan: Path, out: Path, reports: Path) -> Path:
    """Write ``out`` (docs/findings.md): the plan, then the results of what has run, with
    each part's ``postrl report`` pages in ``reports/<part>/``."""
    if not plan.is_file():
        raise DataError(f"{plan}: missing (the pre-registered plan)")
    lines = [f"<!-- Generated by studies/findings/write_report.py from {plan.name} and "
             f"{shown(runs_root)}/; edit the plan there, never the results here. -->", "",
             plan.read_text(encoding="utf-8").rstrip(), "", "## Results", ""]
    verdicts = []
    for experiment in EXPERIMENTS:
        section, rows = results_section(experiment, runs_root / experiment.name,
                                        reports / experiment.name, out)
        lines += section
        verdicts += rows
    if verdicts:
        lines += ["### Verdicts", ""]
        lines += table(["experiment", "claim", "hypothesis", "verdict"], verdicts)
    lines += ["", *time_line(runs_root)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # relative, as `python -m` runs from the repository: the reports name the runs so
    parser.add_argument("runs", type=Path, nargs="?", default=Path(shown(HERE / "results")),
                        help="root of the experiments' kept files (default "
                             "studies/findings/results)")
    parser.add_argument("--plan", type=Path, default=HERE / "plan.md")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "findings.md")
    parser.add_argument("--reports", type=Path, default=HERE / "reports",
                        help="where each part's report pages go (default "
                             "studies/findings/reports)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {write(args.runs, args.plan, args.out, args.reports)}")
    except DataError as err:
        print(f"write_report: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
