"""Intervals, paired tests, power and verdicts of postrl.experiments.stats."""

from __future__ import annotations

import math

import pytest
from scipy import stats as scipy_stats

from postrl.experiments.stats import (
    format_interval,
    format_mean_ci,
    mean_ci95,
    mean_interval,
    min_detectable_effect,
    paired_difference,
    smallest_rank_p,
    t_quantile,
    verdict,
)


def test_mean_interval_is_student_t():
    interval = mean_interval([1.0, 2.0, 3.0])
    assert interval.mean == 2.0
    # s = 1, t(0.975, 2) = 4.303 (statistics tables), half-width = 4.303 / sqrt(3)
    assert interval.high - 2.0 == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    assert t_quantile(30) == pytest.approx(2.042, abs=5e-4)


def test_missing_values_and_one_seed():
    assert mean_ci95([1.0, None, float("nan"), 2.0, 3.0]) == pytest.approx(mean_ci95([1, 2, 3]))
    mean, half_width = mean_ci95([5.0])
    assert mean == 5.0 and math.isnan(half_width)
    assert mean_interval([None]).n == 0
    assert format_interval(mean_interval([5.0])) == "5 (1 seed)"


def test_bounded_interval_stays_in_range():
    # the finding's 0.119 +- 0.271: a share cannot have an interval below 0
    interval = mean_interval([0.0, 0.0, 0.357], bounds=(0.0, 1.0))
    assert interval.low == 0.0 and 0.119 < interval.high <= 1.0
    assert format_interval(interval).startswith("0.119 [0, ")
    assert mean_interval([0.0, 0.0, 0.357]).low < 0  # unbounded, the same numbers go below


def test_equal_seeds_say_so_instead_of_plus_minus_zero():
    interval = mean_interval([0.012] * 3, bounds=(0.0, 1.0))
    assert interval.constant and interval.low == interval.high == 0.012
    assert format_interval(interval) == "0.012 (3 seeds, all equal)"


def test_format_numbers():
    assert format_mean_ci(0.2, 1.2706) == "0.2 ± 1.27"
    assert format_mean_ci(12345.0, 678.0) == "12,345 ± 678"
    assert format_mean_ci(float("nan"), float("nan")) == "–"


def test_paired_difference_pairs_by_seed():
    first = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 9: 7.0}  # seed 9 has no partner
    second = {0: 2.0, 1: 3.5, 2: 3.2, 3: 4.9, 4: 5.3}
    d = paired_difference(first, second)
    assert d.seeds == (0, 1, 2, 3, 4) and d.n == 5
    assert d.differences == pytest.approx((1.0, 1.5, 0.2, 0.9, 0.3))
    expected = scipy_stats.ttest_rel(list(second.values()), [first[s] for s in second])
    low, high = expected.confidence_interval()
    assert (d.low, d.high) == pytest.approx((low, high))
    # exact signed-rank, all five positive: 2 / 2^5 two-sided, the floor for five pairs
    assert d.p_value == pytest.approx(0.0625) and d.test.startswith("Wilcoxon")
    assert smallest_rank_p(5) == 0.0625 and smallest_rank_p(5, "greater") == 1 / 32
    one_sided = paired_difference(first, second, alternative="greater")
    assert one_sided.p_value == pytest.approx(1 / 32) and one_sided.high == math.inf


def test_unpaired_seeds_give_no_difference():
    assert paired_difference({0: 1.0}, {0: 2.0}) is None
    assert paired_difference({0: 1.0, 1: 2.0}, {2: 1.0, 3: 2.0}) is None


def test_ties_use_the_sign_test_and_zero_differences_are_certain_only_of_zero():
    d = paired_difference({0: 1, 1: 2, 2: 3, 3: 0}, {0: 2, 1: 3, 2: 3, 3: 1})
    assert d.test.startswith("sign test")
    assert d.p_value == pytest.approx(scipy_stats.binomtest(3, 3).pvalue)
    same = paired_difference({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
    assert same.p_value == 1.0 and same.mean == 0.0 and not same.excludes_zero


@pytest.mark.parametrize("n, alternative", [(2, "two-sided"), (5, "two-sided"),
                                            (5, "greater"), (12, "two-sided")])
def test_minimum_detectable_effect_has_eighty_percent_power(n, alternative):
    sd = 2.0
    mde = min_detectable_effect(sd, n, alternative)
    df, nc = n - 1, mde * math.sqrt(n) / sd
    if alternative == "two-sided":
        critical = scipy_stats.t.ppf(0.975, df)
        power = scipy_stats.nct.sf(critical, df, nc) + scipy_stats.nct.cdf(-critical, df, nc)
    else:
        power = scipy_stats.nct.sf(scipy_stats.t.ppf(0.95, df), df, nc)
    if n > 2:  # SciPy's nct is unreliable at df = 1, which is why postrl integrates instead
        assert power == pytest.approx(0.8, abs=1e-3)
    assert mde > 0


def test_minimum_detectable_effect_shrinks_with_seeds():
    effects = [min_detectable_effect(1.0, n) for n in (3, 5, 10, 30)]
    assert effects == sorted(effects, reverse=True)
    assert effects[1] == pytest.approx(1.68, abs=0.01)  # Cohen's d for n = 5 pairs, 80% power
    assert math.isnan(min_detectable_effect(1.0, 1))


def test_verdicts():
    up = paired_difference({s: 0.0 for s in range(5)}, {s: 1.0 + 0.1 * s for s in range(5)})
    assert verdict(up, +1).startswith("reproduced (higher")
    assert verdict(up, -1).startswith("opposite (higher")
    noisy = paired_difference({s: 0.0 for s in range(5)},
                              {0: 1.0, 1: -1.2, 2: 0.5, 3: -0.3, 4: 0.1})
    assert verdict(noisy, +1) == (
        f"not resolved (minimum detectable effect {noisy.mde:.3g})")
    assert verdict(None, +1).startswith("not resolved")
    flat = paired_difference({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.0, 1: 2.0, 2: 3.0})
    assert math.isnan(flat.mde) and "no power to state" in verdict(flat, +1)


def test_a_paired_difference_of_fractions_stays_within_plus_minus_one():
    """The case seen on guess_number: zero-variance shares 0.75, 0.75 against 0.75, 1.0."""
    from postrl.experiments.paired import paired_cells, paired_rows

    finals = {"a": {0: {"batch/zero_variance_frac": 0.75}, 1: {"batch/zero_variance_frac": 1.0}},
              "b": {0: {"batch/zero_variance_frac": 0.75}, 1: {"batch/zero_variance_frac": 0.75}}}
    (row,) = paired_rows(finals, ["batch/zero_variance_frac"], consecutive=False)
    unclipped = paired_difference({0: 0.75, 1: 1.0}, {0: 0.75, 1: 0.75})
    assert unclipped.low < -1 and unclipped.high > 1  # what the t-interval alone says
    assert (row.difference.low, row.difference.high) == (-1.0, 1.0)
    assert row.difference.mean == unclipped.mean == -0.125
    cells = paired_cells(row)
    assert cells[3] == "-0.125 [-1, 1]"
    assert row.difference.mde > 1 and cells[5].endswith("(past any possible difference)")
    (length,) = paired_rows({k: {s: {"length/mean": 10 * v["batch/zero_variance_frac"]}
                                 for s, v in seeds.items()} for k, seeds in finals.items()},
                            ["length/mean"], consecutive=False)
    assert length.difference.low < -10  # a length difference is not bounded
