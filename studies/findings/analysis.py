"""The findings' pre-registered analyses (docs/findings.md, "Plan"): one number per run, and a
paired test between two arms of one experiment.

Each function reads one run's step records (``metrics.jsonl``; the record of step 0 holds only
the evaluation before training) and returns one number, or None when the run logged too
little to compute it. :class:`Hypothesis` names the two arms, the number, and the direction
the paper predicts; :func:`test` pairs the arms by seed and gives the verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats as scipy_stats

from postrl.experiments.stats import PairedDifference, finite, paired_difference, verdict

Records = Sequence[Mapping[str, Any]]
Measure = Callable[[Records], float | None]  # one number per run


def steps(records: Records) -> list[Mapping[str, Any]]:
    """The records of optimizer steps (step >= 1)."""
    return [r for r in records if r.get("step", 0) >= 1]


def incorrect_length_slope(records: Records) -> float | None:
    """Slope of the mean incorrect-response length over generated tokens (per 1,000).

    E1's primary: the least-squares slope of ``length/incorrect_mean`` (tokens) against
    ``rollout/tokens_generated`` / 1,000 over the run's steps; None with fewer than 3 points."""
    points = [(r["rollout/tokens_generated"] / 1000, r["length/incorrect_mean"])
              for r in steps(records) if finite([r.get("length/incorrect_mean")])]
    if len(points) < 3:
        return None
    x, y = zip(*points, strict=True)
    return float(scipy_stats.linregress(x, y).slope)


def _eval(records: Records, metric: str) -> list[float]:
    return finite(r.get(metric) for r in records)


def heldout_gain(records: Records) -> float | None:
    """Held-out sampled pass@1 gain from step 0 to the end (total, not per step)."""
    values = _eval(records, "eval/sampled_accuracy")
    if len(values) < 2 or not steps(records) or records[0].get("step") != 0:
        return None
    return values[-1] - values[0]


def heldout_gain_per_step(records: Records) -> float | None:
    """Held-out sampled pass@1 gain from step 0 to the end, per optimizer step (E2)."""
    gain = heldout_gain(records)
    return None if gain is None else gain / len(steps(records))


def heldout_final(records: Records) -> float | None:
    """Held-out sampled pass@1 at the budget's end."""
    values = _eval(records, "eval/sampled_accuracy")
    return values[-1] if values and steps(records) else None


def mean_over_steps(metric: str) -> Callable[[Records], float | None]:
    """The mean of ``metric`` over the run's steps."""
    def mean(records: Records) -> float | None:
        values = finite(r.get(metric) for r in steps(records))
        return sum(values) / len(values) if values else None

    mean.__name__ = f"mean {metric}"
    mean.__doc__ = f"Mean of {metric} over the run's steps."
    return mean


def grad_norm_spikiness(records: Records) -> float | None:
    """Largest over median gradient norm of the run (1 = no spike)."""
    norms = finite(r.get("grad/norm") for r in steps(records))
    if len(norms) < 2 or statistics.median(norms) == 0:
        return None
    return max(norms) / statistics.median(norms)


def ratio_warnings(records: Records) -> float | None:
    """Ratio warnings postrl diagnose gives the run (heavy tail, clip spike, spread)."""
    from postrl.experiments.diagnose import View, check_ratios

    if not steps(records):
        return None
    return float(len(check_ratios(View(list(records), {}))))


def steps_taken(records: Records) -> float | None:
    """Optimizer steps within the budget."""
    return float(len(steps(records))) or None


def wasted_share(records: Records) -> float | None:
    """Share of generated tokens wasted on groups dynamic sampling dropped."""
    last = steps(records)[-1] if steps(records) else {}
    generated = last.get("rollout/tokens_generated") or 0
    return (last.get("rollout/tokens_wasted") or 0) / generated if generated else None


@dataclass(frozen=True)
class Hypothesis:
    """``second`` differs from ``first`` in ``measure`` with sign ``expected`` (+1 higher,
    -1 lower; 0 = no direction). Only a primary hypothesis is tested in its direction: the plan
    describes secondaries two-sided, whatever was expected of them. ``claim`` names the part of
    the paper's claim the hypothesis speaks to, for the page's verdict table ("" = none)."""

    first: str
    second: str
    measure: Callable[[Records], float | None]
    expected: int
    primary: bool = False
    claim: str = ""

    @property
    def alternative(self) -> str:
        if not self.primary:
            return "two-sided"
        return {1: "greater", -1: "less", 0: "two-sided"}[self.expected]


@dataclass(frozen=True)
class Outcome:
    """A hypothesis tested: each arm's per-seed values, the paired difference the verdict reads
    (``tested``: one-sided in the predicted direction for a primary, two-sided for a
    secondary), the two-sided one, and the verdict."""

    hypothesis: Hypothesis
    first: dict[int, float | None]
    second: dict[int, float | None]
    tested: PairedDifference | None
    two_sided: PairedDifference | None
    verdict: str


def test(hypothesis: Hypothesis, runs: Mapping[str, Mapping[int, Records]]) -> Outcome:
    """Pair the two arms by seed and decide. A primary: "reproduced" needs the interval in the
    predicted direction to exclude 0; "opposite" needs the two-sided interval to exclude 0 the
    other way; anything else is "not resolved" with its minimum detectable effect. A
    secondary is described: "differs" when its two-sided interval excludes 0."""
    first = {seed: hypothesis.measure(r) for seed, r in runs[hypothesis.first].items()}
    second = {seed: hypothesis.measure(r) for seed, r in runs[hypothesis.second].items()}
    two_sided = paired_difference(first, second)
    if not hypothesis.primary or hypothesis.expected == 0:
        return Outcome(hypothesis, first, second, two_sided, two_sided,
                       _described(two_sided, hypothesis.expected))
    directional = paired_difference(first, second, hypothesis.alternative)
    if directional is not None and directional.excludes_zero:
        said = verdict(directional, hypothesis.expected)
    elif two_sided is not None and two_sided.excludes_zero:
        said = verdict(two_sided, hypothesis.expected)  # the interval says the opposite
    else:
        said = verdict(directional, hypothesis.expected)
    return Outcome(hypothesis, first, second, directional, two_sided, said)


def _described(difference: PairedDifference | None, expected: int) -> str:
    if difference is None or not difference.excludes_zero:
        return verdict(difference, +1)  # "not resolved (...)"; the sign is not used there
    said = "differs (" + ("higher" if difference.mean > 0 else "lower")
    if expected:
        said += "; " + ("higher" if expected > 0 else "lower") + " was expected"
    return said + "; the two-sided interval excludes 0)"


def describe(measure: Callable[..., Any]) -> str:
    """The first line of a measure's docstring, for tables."""
    return (measure.__doc__ or measure.__name__).strip().splitlines()[0]
