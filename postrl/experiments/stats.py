"""Statistics for comparing runs over seeds, from SciPy: intervals, paired tests and power.

- :func:`mean_interval`: the mean over seeds and its 95% Student-t interval, clipped to the
  range the quantity can take (a share never gets an interval below 0 or above 1).
- :func:`paired_difference`: arms that share seeds share prompts and first samples, so they
  are compared seed by seed: the mean of the per-seed differences, its 95% t-interval, the
  Wilcoxon signed-rank p-value (exact for small samples without ties) and the minimum
  detectable effect at 80% power of the paired t-test, from the observed spread.
- :func:`verdict`: "reproduced", "not resolved (minimum detectable effect X)" or "opposite".

A rank test over n pairs cannot go below p = 2 / 2^n two-sided (1 / 2^n one-sided): with
5 seeds, 0.0625 two-sided. :func:`smallest_rank_p` says so, and the findings choose seeds or a
pre-registered one-sided hypothesis accordingly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scipy import integrate, optimize
from scipy import stats as scipy_stats

ALPHA = 0.05
POWER = 0.8
ALTERNATIVES = ("two-sided", "greater", "less")  # greater: the second arm is larger
Bounds = tuple[float, float]
UNBOUNDED: Bounds = (-math.inf, math.inf)


def finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers and finite (``None`` and NaN, i.e. JSON null, dropped)."""
    out = []
    for value in values:
        if value is not None and math.isfinite(float(value)):
            out.append(float(value))
    return out


def t_quantile(df: int, level: float = 1 - ALPHA / 2) -> float:
    """The ``level`` quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return float(scipy_stats.t.ppf(level, df))


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` seeds and its 95% interval (NaN bounds when n < 2)."""

    mean: float
    low: float
    high: float
    n: int
    constant: bool = False  # every seed gave the same value


def mean_interval(values: Iterable[float | None], bounds: Bounds = UNBOUNDED) -> Interval:
    """The mean and its 95% Student-t interval, ``mean ± t(0.975, n-1) s / sqrt(n)`` with
    Bessel's ``s``, intersected with ``bounds``. Non-finite values and ``None`` are left out."""
    xs = finite(values)
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    if max(xs) == min(xs):  # equal values: no spread, not a rounding residue
        return Interval(xs[0], xs[0], xs[0], n, constant=True)
    half = t_quantile(n - 1) * math.sqrt(_variance(xs, mean) / n)
    return Interval(mean, max(mean - half, bounds[0]), min(mean + half, bounds[1]), n)


def mean_ci95(values: Iterable[float | None]) -> tuple[float, float]:
    """``(mean, half_width)`` of the unbounded 95% t-interval (NaN half-width for one seed)."""
    interval = mean_interval(values)
    return interval.mean, (interval.high - interval.mean if interval.n > 1 else math.nan)


def format_interval(interval: Interval, digits: int = 3) -> str:
    """``"0.512 [0.48, 0.54]"``; ``"0 (3 seeds, all equal)"``; ``"0.5 (1 seed)"``; ``"–"``."""
    if interval.n == 0 or not math.isfinite(interval.mean):
        return "–"
    mean = format_number(interval.mean, digits)
    if interval.n == 1:
        return f"{mean} (1 seed)"
    if interval.constant:
        return f"{mean} ({interval.n} seeds, all equal)"
    return f"{mean} [{format_number(interval.low, digits)}, {format_number(interval.high, digits)}]"


def format_mean_ci(mean: float, half_width: float, digits: int = 3) -> str:
    """``"0.512 ± 0.031"``; just the mean when the half-width is unknown; ``"–"`` for none."""
    if not math.isfinite(mean):
        return "–"
    text = format_number(mean, digits)
    if math.isfinite(half_width):
        text += f" ± {format_number(half_width, digits)}"
    return text


def format_number(value: float, digits: int = 3) -> str:
    """Significant digits for small numbers, thousands separators for large ones."""
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _variance(xs: list[float], mean: float) -> float:
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


# ---- paired comparisons -----------------------------------------------------------------
@dataclass(frozen=True)
class PairedDifference:
    """``second - first`` seed by seed, over the seeds both arms ran.

    ``low``/``high`` bound the 95% t-interval of the mean difference (one-sided for a one-sided
    ``alternative``: the other bound is infinite). ``p_value`` is the Wilcoxon signed-rank test's
    (``test`` names the method SciPy used); ``mde`` the smallest true mean difference the paired
    t-test detects with 80% power at ``ALPHA``, given the observed spread of the differences.
    """

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    low: float
    high: float
    p_value: float
    test: str
    mde: float
    alternative: str = "two-sided"

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_difference(first: Mapping[int, float | None], second: Mapping[int, float | None],
                      alternative: str = "two-sided") -> PairedDifference | None:
    """Compare two arms by seed (``{seed: value}`` each); None with fewer than 2 shared seeds."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    seeds = tuple(sorted(s for s in first.keys() & second.keys()
                         if finite([first[s]]) and finite([second[s]])))
    if len(seeds) < 2:
        return None
    d = [float(second[s]) - float(first[s]) for s in seeds]  # type: ignore[arg-type]
    n, mean = len(d), sum(d) / len(d)
    sd = math.sqrt(_variance(d, mean))
    low, high = _t_bounds(mean, sd, n, alternative)
    p_value, test = wilcoxon(d, alternative)
    return PairedDifference(seeds, tuple(d), mean, low, high, p_value, test,
                            min_detectable_effect(sd, n, alternative), alternative)


def _t_bounds(mean: float, sd: float, n: int, alternative: str) -> tuple[float, float]:
    se = sd / math.sqrt(n)
    if alternative == "two-sided":
        half = t_quantile(n - 1) * se
        return mean - half, mean + half
    one = t_quantile(n - 1, 1 - ALPHA) * se
    return (mean - one, math.inf) if alternative == "greater" else (-math.inf, mean + one)


def wilcoxon(differences: list[float], alternative: str = "two-sided") -> tuple[float, str]:
    """An exact p-value and its test: Wilcoxon's signed-rank test when the differences have
    no zeros and no tied magnitudes, else the sign test over the nonzero ones; p = 1 when every
    difference is 0."""
    nonzero = [x for x in differences if x != 0]
    if not nonzero:
        return 1.0, "all differences 0"
    if len(nonzero) == len(differences) and len({abs(x) for x in nonzero}) == len(nonzero):
        result = scipy_stats.wilcoxon(differences, alternative=alternative, method="exact")
        return float(result.pvalue), "Wilcoxon signed-rank, exact"
    positive = sum(x > 0 for x in nonzero)
    result = scipy_stats.binomtest(positive, len(nonzero), 0.5, alternative=alternative)
    return float(result.pvalue), "sign test, exact (zeros or ties)"


def smallest_rank_p(n: int, alternative: str = "two-sided") -> float:
    """The smallest p-value a signed-rank (or sign) test over ``n`` pairs can reach."""
    return (2.0 if alternative == "two-sided" else 1.0) / 2**n


def min_detectable_effect(sd: float, n: int, alternative: str = "two-sided",
                          alpha: float = ALPHA, power: float = POWER) -> float:
    """The true mean difference a paired t-test over ``n`` pairs detects with ``power``.

    Solves ``P(reject | delta) = power`` for ``delta``, the statistic following a noncentral t
    with noncentrality ``delta sqrt(n) / sd``. NaN for n < 2 and when the differences do not
    vary (no spread to size an effect against).
    """
    if n < 2 or not math.isfinite(sd) or sd == 0:
        return math.nan
    df = n - 1
    two_sided = alternative == "two-sided"
    critical = t_quantile(df, 1 - alpha / 2 if two_sided else 1 - alpha)
    high = 1.0
    while _t_test_power(high, df, critical, two_sided) < power:
        high *= 2
    noncentrality = optimize.brentq(
        lambda nc: _t_test_power(nc, df, critical, two_sided) - power, 0.0, high)
    return noncentrality * sd / math.sqrt(n)


def _t_test_power(noncentrality: float, df: int, critical: float, two_sided: bool) -> float:
    """P(|T| > critical) (or P(T > critical)) for T = (Z + noncentrality) / sqrt(V / df),
    integrated over V ~ chi2(df): SciPy's ``nct`` returns NaN for df = 1 and large
    noncentralities, which this integral does not. The integrand is written with ``math``:
    SciPy's distribution objects cost ~50x more a call, and a findings page calls it ~10^6
    times."""
    half = df / 2
    log_norm = half * math.log(2) + math.lgamma(half)  # chi2(df)'s density's normaliser

    def rejected(v: float) -> float:
        if v <= 0:  # quad never evaluates the end point; the density is 0 or infinite there
            return 0.0
        bound = critical * math.sqrt(v / df)
        p = 0.5 * math.erfc((bound - noncentrality) / math.sqrt(2))  # P(Z > bound - nc)
        if two_sided:
            p += 0.5 * math.erfc((bound + noncentrality) / math.sqrt(2))  # P(Z < -bound - nc)
        return p * math.exp((half - 1) * math.log(v) - v / 2 - log_norm)

    return float(integrate.quad(rejected, 0, math.inf, limit=200)[0])


def verdict(difference: PairedDifference | None, expected_sign: int) -> str:
    """The findings' three verdicts for an effect expected to have ``expected_sign`` (+1/-1)."""
    if difference is None:
        return "not resolved (fewer than 2 paired seeds)"
    if difference.excludes_zero:
        direction = "higher" if difference.mean > 0 else "lower"
        if (difference.mean > 0) == (expected_sign > 0):
            return f"reproduced ({direction}; the paired interval excludes 0)"
        return f"opposite ({direction}; the paired interval excludes 0)"
    if not math.isfinite(difference.mde):
        return "not resolved (the seeds' differences do not vary: no power to state)"
    return f"not resolved (minimum detectable effect {format_number(difference.mde)})"
