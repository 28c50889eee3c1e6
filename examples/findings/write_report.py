"""docs/findings.md from the pre-registered plan (``plan.md``, copied verbatim) and the runs.

    python examples/findings/write_report.py runs/findings --out docs/findings.md

For each experiment of ``findings_plan.py`` that has run, the results section gives every
hypothesis's per-seed values, the paired difference (one-sided in the predicted direction),
its p-value and minimum detectable effect, and the verdict; then the cost (steps, tokens,
wall time) and ``postrl report``'s tables and curves in ``docs/findings/<experiment>/``. An
experiment that has not run is listed as such, never skipped silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from analysis import Outcome, describe, steps_taken, test
from findings_plan import EXPERIMENTS, RUN_RECORD, Experiment

from postrl.errors import DataError
from postrl.experiments.report import load_run, write_report
from postrl.experiments.stats import format_interval, format_number, mean_interval

HERE = Path(__file__).resolve().parent


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
    h, d = outcome.hypothesis, outcome.directional
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


def results_section(experiment: Experiment, root: Path, figures: Path) -> tuple[list[str], list]:
    """The Markdown of one experiment's results and its primary outcomes."""
    title = f"### {experiment.title}"
    if not (root / RUN_RECORD).is_file():
        return [title, "", f"Not run yet: `make findings-{experiment.name}`.", ""], []
    arms = load_arms(root)
    outcomes = [test(h, arms) for h in experiment.hypotheses]
    record = json.loads((root / RUN_RECORD).read_text())
    primary = [o for o in outcomes if o.hypothesis.primary]
    lines = [title, "", f"Command: `{record['command']}`; wall time "
             f"{record['wall_seconds'] / 60:.1f} min. Run directories: `{root}/<arm>/s<seed>`.",
             ""]
    if record.get("note"):  # how the runs came about, where that is not the command alone
        lines += [f"*Provenance.* {record['note']}", ""]
    rows = [outcome_row(o) for o in primary]
    lines += ["**Primary** (pre-registered):", ""] + table(HEADERS, rows)
    secondary = [outcome_row(o) for o in outcomes if not o.hypothesis.primary]
    lines += ["", "**Secondary** (described, not tested for the claim):", ""]
    lines += table(HEADERS, secondary)
    if any("–" in cell for row in rows + secondary for cell in row):
        lines += ["", "–: no value, and the seed is left out of that pair (e.g. the "
                  "gradient-norm ratio of a run whose median gradient norm is 0: most of its "
                  "steps had no group with a spread of rewards)."]
    cost = [[label, format_interval(mean_interval(steps_taken(r) for r in seeds.values())),
             format_interval(mean_interval(
                 r[-1].get("rollout/tokens_generated") for r in seeds.values()))]
            for label, seeds in arms.items()]
    lines += ["", "**Cost** per run, mean over seeds [95% CI]:", ""]
    lines += table(["arm", "optimizer steps", "tokens generated"], cost)
    report_html, report_md = write_report([root], figures)
    lines += ["", f"Every summary metric paired by seed, and the curves: "
              f"[{report_md.relative_to(figures.parent.parent)}]"
              f"({report_md.relative_to(figures.parent.parent)}).", ""]
    return lines, primary


def write(runs_root: Path, plan: Path, out: Path) -> Path:
    """Write ``out`` (docs/findings.md): the plan, then the results of what has run."""
    if not plan.is_file():
        raise DataError(f"{plan}: missing (the pre-registered plan)")
    lines = [f"<!-- Generated by examples/findings/write_report.py from {plan.name} and "
             f"{runs_root}/; edit the plan there, never the results here. -->", "",
             plan.read_text(encoding="utf-8").rstrip(), "", "## Results", ""]
    verdicts = []
    for experiment in EXPERIMENTS:
        section, primary = results_section(experiment, runs_root / experiment.name,
                                           out.parent / "findings" / experiment.name)
        lines += section
        verdicts += [(experiment.title, o.verdict) for o in primary]
    if verdicts:
        lines += ["### Verdicts", ""] + table(["experiment", "primary verdict"], verdicts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, help="root of the experiments (runs/findings)")
    parser.add_argument("--plan", type=Path, default=HERE / "plan.md")
    parser.add_argument("--out", type=Path, default=Path("docs/findings.md"))
    args = parser.parse_args(argv)
    try:
        print(f"wrote {write(args.runs, args.plan, args.out)}")
    except DataError as err:
        print(f"write_report: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
