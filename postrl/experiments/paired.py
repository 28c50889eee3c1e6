"""Arms compared seed by seed: each seed's final values, and paired differences between arms.

Runs of one seed share prompts and first samples whatever the recipe, so a comparison of two
arms is paired: the per-seed differences, their mean with a 95% t-interval, an exact rank-test
p-value and the minimum detectable effect at 80% power (:mod:`postrl.experiments.stats`).
``compare`` pairs every arm with the first; ``ladder`` each rung with the one before it.

A run's *final* value of a metric is its last finite logged value; held-out evaluation runs at
the last step, so ``eval/*`` finals are taken at the run's budget end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from postrl.experiments.stats import (
    PairedDifference,
    finite,
    format_interval,
    format_number,
    mean_interval,
    paired_difference,
    smallest_rank_p,
)
from postrl.telemetry.names import value_range

FINAL_METRICS: tuple[str, ...] = (
    "reward/mean", "accuracy/mean", "eval/accuracy", "eval/sampled_accuracy", "length/mean",
    "length/correct_mean", "length/incorrect_mean", "length/truncated_frac", "entropy/mean",
    "clip/low_frac", "clip/high_frac", "clip/token_frac", "batch/zero_variance_frac", "kl/mean",
    "ratio/seq_std", "grad/norm", "episode/turns_mean", "episode/env_tokens_mean",
)
Finals = dict[str, dict[int, dict[str, float | None]]]  # arm -> seed -> metric -> final value


def final_values(records: Iterable[Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """Each metric's last finite value over a run's records (None if never logged)."""
    finals: dict[str, Any] = dict.fromkeys(metrics)
    for record in records:
        for metric in metrics:
            if finite([record.get(metric)]):
                finals[metric] = float(record[metric])
    return finals


def arm_pairs(labels: Sequence[str], consecutive: bool) -> list[tuple[str, str]]:
    """(first, second) arms to compare: each with the one before it, or each with the first."""
    if consecutive:
        return list(zip(labels, labels[1:], strict=False))
    return [(labels[0], label) for label in labels[1:]]


@dataclass(frozen=True)
class PairedRow:
    """One metric, ``second - first`` over the seeds both arms ran."""

    metric: str
    first: str
    second: str
    difference: PairedDifference | None


def paired_rows(finals: Finals, metrics: Sequence[str], consecutive: bool) -> list[PairedRow]:
    """Per pair of arms, one row per metric that both arms logged."""
    rows = []
    for first, second in arm_pairs(list(finals), consecutive):
        for metric in metrics:
            a = {seed: values.get(metric) for seed, values in finals[first].items()}
            b = {seed: values.get(metric) for seed, values in finals[second].items()}
            if finite(a.values()) and finite(b.values()):
                difference = within(paired_difference(a, b), difference_range(metric))
                rows.append(PairedRow(metric, first, second, difference))
    return rows


def difference_range(metric: str) -> tuple[float, float]:
    """The values a difference of two of ``metric``'s values can take: [-1, 1] for a
    fraction, unbounded otherwise."""
    low, high = value_range(metric)
    return low - high, high - low


def within(difference: PairedDifference | None,
           bounds: tuple[float, float]) -> PairedDifference | None:
    """``difference`` with its interval intersected with ``bounds``: the t-interval of a
    difference of two fractions over few seeds can reach past ±1, which no difference can."""
    if difference is None:
        return None
    return replace(difference, low=max(difference.low, bounds[0]),
                   high=min(difference.high, bounds[1]))


PAIRED_HEADERS = ("metric", "arms", "per-seed differences", "mean [95% CI]", "p", "MDE (80%)")


def paired_cells(row: PairedRow) -> list[str]:
    """The row as table cells (see ``PAIRED_HEADERS``)."""
    d = row.difference
    arms = f"{row.second} - {row.first}"
    if d is None:
        return [row.metric, arms, "fewer than 2 shared seeds", "–", "–", "–"]
    spread = ", ".join(format_number(x) for x in d.differences)
    if len(set(d.differences)) == 1:  # no spread: an interval of width 0 would read as certainty
        interval, mde = f"{format_number(d.mean)} (all {d.n} equal)", "– (no spread)"
    else:
        interval = f"{format_number(d.mean)} [{format_number(d.low)}, {format_number(d.high)}]"
        span = difference_range(row.metric)[1]
        mde = format_number(d.mde) + (" (past any possible difference)" if d.mde > span else "")
    return [row.metric, arms, spread, interval, f"{d.p_value:.3g} ({d.test})", mde]


def power_note(finals: Finals) -> str:
    """What the seeds run can resolve, said before anyone reads a p-value."""
    n = min((len(seeds) for seeds in finals.values()), default=0)
    return (f"Paired by seed ({n} seeds per arm): differences are second arm minus first; mean "
            "with its 95% Student-t interval; p from Wilcoxon's signed-rank test (the sign test "
            f"when there are zeros or ties), which with {n} pairs cannot go below "
            f"{smallest_rank_p(n):.3g} two-sided; MDE = the smallest true mean difference a "
            "paired t-test over these seeds detects with 80% power at alpha 0.05, from the "
            "observed spread. Many metrics are shown: only a pre-registered primary metric is a "
            "test; the rest describe.")


def seed_cells(finals: Finals, label: str, metric: str, seeds: Sequence[int]) -> list[str]:
    """One arm's per-seed final values of ``metric``, then their mean and bounded interval."""
    values = [finals[label].get(seed, {}).get(metric) for seed in seeds]
    cells = ["–" if v is None else format_number(v) for v in values]
    return [*cells, format_interval(mean_interval(values, value_range(metric)))]


def seed_rows(finals: Finals, metrics: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows (metric x arm) of every seed's final value."""
    seeds = sorted({seed for per_seed in finals.values() for seed in per_seed})
    rows = []
    for metric in metrics:
        for label in finals:
            cells = seed_cells(finals, label, metric, seeds)
            if any(cell != "–" for cell in cells[:-1]):
                rows.append([metric, label, *cells])
    return ["metric", "arm", *(f"seed {s}" for s in seeds), "mean [95% CI]"], rows


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (pasteable into Markdown code blocks)."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
