"""Mean and 95% Student-t confidence interval over seeds, checked by hand."""

import math
import sys

import pytest

from postrl.experiments.stats import T_975, format_mean_ci, mean_ci95, t_quantile_975


def test_half_width_of_one_two_three_by_hand():
    # mean 2, s = 1 (Bessel), t(0.975, df=2) = 4.303  ->  4.303 / sqrt(3) = 2.4843
    mean, half_width = mean_ci95([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0)
    assert half_width == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert half_width == pytest.approx(2.484, abs=1e-3)


def test_two_seeds_use_t_with_one_degree_of_freedom():
    # values 0.1 and 0.3: s = 0.1414, t(0.975, 1) = 12.706 -> 12.706 * 0.1414 / sqrt(2) = 1.2706
    mean, half_width = mean_ci95([0.1, 0.3])
    assert mean == pytest.approx(0.2)
    assert half_width == pytest.approx(1.2706, abs=1e-3)


def test_missing_values_are_left_out():
    assert mean_ci95([1.0, None, float("nan"), 2.0, 3.0]) == pytest.approx(mean_ci95([1, 2, 3]))
    mean, half_width = mean_ci95([5.0])
    assert mean == 5.0 and math.isnan(half_width)
    assert all(math.isnan(x) for x in mean_ci95([None]))


def test_equal_values_have_no_spread():
    assert mean_ci95([0.012] * 3) == (0.012, 0.0)


def test_table_without_scipy(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # makes `from scipy import ...` fail
    assert t_quantile_975(2) == 4.303
    assert t_quantile_975(30) == T_975[-1] == 2.042
    assert t_quantile_975(31) == 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_format():
    assert format_mean_ci(0.2, 1.2706) == "0.2 ± 1.27"
    assert format_mean_ci(12345.0, 678.0) == "12,345 ± 678"
    assert format_mean_ci(0.5, float("nan")) == "0.5"
    assert format_mean_ci(float("nan"), float("nan")) == "–"
