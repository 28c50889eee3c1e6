"""Small statistics for comparing runs over seeds: the mean and its 95% confidence interval.

The interval is Student's t: ``mean ± t(0.975, n − 1) · s / √n`` with ``s`` the sample
(Bessel-corrected, ``n − 1``) standard deviation. The t quantile comes from SciPy when it is
installed; otherwise from :data:`T_975`, the two-sided 95% quantiles for 1..30 degrees of
freedom (three decimals, as printed in statistics tables), and 1.96 (the normal quantile)
beyond 30. The two sources agree to 5e-4 for df ≤ 30.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# t(0.975, df) for df = 1..30; index 0 is df = 1.
T_975: tuple[float, ...] = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)
NORMAL_975 = 1.96  # used for df > 30 when SciPy is absent


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` ≥ 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    try:
        from scipy import stats as scipy_stats
    except ImportError:
        return T_975[df - 1] if df <= len(T_975) else NORMAL_975
    return float(scipy_stats.t.ppf(0.975, df))


def finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers and finite (``None`` and NaN, i.e. JSON null, dropped)."""
    out = []
    for value in values:
        if value is not None and math.isfinite(float(value)):
            out.append(float(value))
    return out


def mean_ci95(values: Iterable[float | None]) -> tuple[float, float]:
    """``(mean, half_width)`` of the 95% Student-t confidence interval of the mean.

    Non-finite values and ``None`` are left out. With no value both are NaN; with one value
    the half-width is NaN (one seed says nothing about the spread).
    """
    xs = finite(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    mean = sum(xs) / n
    if n == 1:
        return mean, math.nan
    if max(xs) == min(xs):  # equal values: exactly no spread, not a rounding residue
        return xs[0], 0.0
    variance = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, t_quantile_975(n - 1) * math.sqrt(variance / n)


def format_mean_ci(mean: float, half_width: float, digits: int = 3) -> str:
    """``"0.512 ± 0.031"``; just the mean when the half-width is unknown; ``"–"`` for none."""
    if not math.isfinite(mean):
        return "–"
    text = _format_number(mean, digits)
    if math.isfinite(half_width):
        text += f" ± {_format_number(half_width, digits)}"
    return text


def _format_number(value: float, digits: int) -> str:
    """Significant digits for small numbers, thousands separators for large ones."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"
