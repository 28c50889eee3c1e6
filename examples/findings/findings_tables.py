"""The numbers of docs/findings.md: one value per run for each table row, then mean ± 95% CI
over seeds (``postrl.experiments.stats``).

A row is a small pure function of one run. "Early" and "late" are the first and the last third
of a run's logged steps (at least one step each), so runs that stop at different step counts
under the same token budget are compared at the same stage. Rows marked *samples* read
``samples.jsonl``, which must log every generated response (``log_samples`` >= prompts x group
x sampling rounds); otherwise they raise a DataError naming the file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from findings_data import ExperimentData, RunData

from postrl.errors import DataError
from postrl.experiments.stats import finite, format_mean_ci, mean_ci95

TOKENS = "rollout/tokens_generated"


def values(run: RunData, metric: str) -> list[float]:
    """The finite values of ``metric`` over the run's steps, in step order."""
    return finite(record.get(metric) for record in run.records)


def _third(items: Sequence[Any], late: bool) -> Sequence[Any]:
    """The first (or last) third of ``items``, at least one."""
    size = max(1, len(items) // 3)
    return items[-size:] if late else items[:size]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _mean_over(run: RunData, metric: str, late: bool) -> float | None:
    """Mean of the finite values of ``metric`` in the first/last third of the logged steps."""
    return _mean(finite(record.get(metric) for record in _third(run.records, late)))


def early(metric: str) -> Callable[[RunData], float | None]:
    return lambda run: _mean_over(run, metric, late=False)


def late(metric: str) -> Callable[[RunData], float | None]:
    return lambda run: _mean_over(run, metric, late=True)


def change(metric: str) -> Callable[[RunData], float | None]:
    """Late minus early."""
    def of(run: RunData) -> float | None:
        first, last = early(metric)(run), late(metric)(run)
        return None if first is None or last is None else last - first
    return of


def over_run(metric: str) -> Callable[[RunData], float | None]:
    return lambda run: _mean(values(run, metric))


def last(metric: str) -> Callable[[RunData], float | None]:
    return lambda run: (values(run, metric) or [None])[-1]


def largest(metric: str) -> Callable[[RunData], float | None]:
    return lambda run: max(values(run, metric), default=None)


def smallest(metric: str) -> Callable[[RunData], float | None]:
    return lambda run: min(values(run, metric), default=None)


def steps(run: RunData) -> float:
    return float(len(run.records))


def wasted_share(run: RunData) -> float | None:
    generated, wasted = last(TOKENS)(run), last("rollout/tokens_wasted")(run)
    return None if not generated or wasted is None else wasted / generated


def logged_seconds(run: RunData) -> float | None:
    """Step and evaluation seconds summed over the run (model loading and saving excluded)."""
    total = sum(values(run, "time/step_s")) + sum(values(run, "time/eval_s"))
    return total or None


# ---- rows read from samples.jsonl ------------------------------------------------------------

def complete_samples(run: RunData) -> dict[int, list[dict[str, Any]]]:
    """Step -> every response generated at that step; DataError when some were not logged."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in run.samples:
        by_step.setdefault(int(row["step"]), []).append(row)
    previous = 0
    for record in run.records:
        generated = int(record["rollout/responses"]) - previous
        previous = int(record["rollout/responses"])
        logged = len(by_step.get(int(record["step"]), []))
        if logged != generated:
            raise DataError(f"{run.path}/samples.jsonl: step {record['step']} logs {logged} of "
                            f"its {generated} responses; set log_samples >= prompts_per_step x "
                            "group_size x max_sampling_rounds in the experiment's config")
    return by_step


def sampled_accuracy_per_step(run: RunData) -> list[float]:
    """Share of correct answers among ALL responses generated at each step (dropped groups
    included, unlike accuracy/mean)."""
    return [sum(bool(r["correct"]) for r in rows) / len(rows)
            for _, rows in sorted(complete_samples(run).items()) if rows]


def late_sampled_accuracy(run: RunData) -> float | None:
    return _mean(_third(sampled_accuracy_per_step(run), late=True))


def correct_per_1k_tokens(run: RunData) -> float | None:
    """Correct answers per 1,000 generated tokens over the whole run (wasted ones included)."""
    rows = [r for rows in complete_samples(run).values() for r in rows]
    tokens = sum(int(r["length"]) for r in rows)
    return 1000 * sum(bool(r["correct"]) for r in rows) / tokens if tokens else None


# ---- tables ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One table row: a key for notes.md placeholders, what it shows, and its per-run value."""

    key: str
    label: str
    value: Callable[[RunData], float | None]


def cell(runs: Sequence[RunData], row: Row) -> tuple[float, float]:
    """``(mean, half-width)`` of the row over the runs (seeds)."""
    return mean_ci95(row.value(run) for run in runs)


def cell_text(runs: Sequence[RunData], row: Row) -> str:
    return format_mean_ci(*cell(runs, row))


def markdown_table(data: ExperimentData, rows: Sequence[Row]) -> str:
    """Rows = the experiment's rows, columns = its recipes (n = seeds), mean ± 95% CI."""
    header = ["", *(f"{label} (n={len(runs)})" for label, runs in data.groups.items())]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(data.groups) + "|"]
    for row in rows:
        cells = [cell_text(runs, row) for runs in data.groups.values()]
        lines.append("| " + " | ".join([row.label, *cells]) + " |")
    return "\n".join(lines)


def find_row(rows: Sequence[Row], key: str) -> Row:
    for row in rows:
        if row.key == key:
            return row
    raise KeyError(key)
