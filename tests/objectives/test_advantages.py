"""Advantage estimators on small cases whose expected values were worked out by hand."""

import pytest
import torch

from postrl.objectives import advantages as adv


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_group_std_scaling_bessel_and_population():
    rewards = t(1, 0, 1, 0, 2, 2, 2, 2)
    # group 1: mean 0.5, deviations ±0.5, Bessel var = 1/3, std = 0.5773503; A = ±0.8660254
    expected = t(0.8660254, -0.8660254, 0.8660254, -0.8660254, 0, 0, 0, 0)
    torch.testing.assert_close(adv.group(rewards, 4), expected, atol=2e-6, rtol=0)
    # population std = 0.5: A = ±1 (less the eps)
    expected = t(1, -1, 1, -1, 0, 0, 0, 0)
    torch.testing.assert_close(adv.group(rewards, 4, std="population"), expected, atol=5e-6, rtol=0)


def test_group_batch_scale_and_no_scale():
    rewards = t(1, 0, 1, 0, 2, 2, 2, 2)
    # batch mean 1.25, squared deviations sum to 5.5, Bessel var 5.5/7, std 0.8864053;
    # the group-centred rewards ±0.5 divided by it: ±0.5640761
    expected = t(0.5640761, -0.5640761, 0.5640761, -0.5640761, 0, 0, 0, 0)
    torch.testing.assert_close(adv.group(rewards, 4, scale="batch"), expected, atol=2e-6, rtol=0)
    expected = t(0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0)
    torch.testing.assert_close(adv.group(rewards, 4, scale="none"), expected)


def test_zero_variance_group_is_exactly_zero_despite_rounding():
    rewards = t(0.1, 0.1, 0.1, 0.7, 0.7, 0.7)
    for scale in ("group", "batch", "none"):
        assert torch.equal(adv.group(rewards, 3, scale=scale), torch.zeros(6, dtype=torch.float64))
    assert torch.equal(adv.rloo(rewards, 3), torch.zeros(6, dtype=torch.float64))


def test_rloo():
    # A_0 = 1 - mean(0, 0) = 1; A_1 = 0 - mean(1, 0) = -0.5; likewise A_2
    torch.testing.assert_close(adv.rloo(t(1, 0, 0), 3), t(1, -0.5, -0.5))
    with pytest.raises(ValueError, match="group_size >= 2"):
        adv.rloo(t(1, 0), 1)


def test_group_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        adv.group(t(1, 0, 1), 4)


def test_outcome_token_rewards_on_last_valid_token():
    mask = t([1, 1, 0], [0, 0, 0], [1, 1, 1])
    expected = t([0, 2, 0], [0, 0, 0], [0, 0, 4])
    torch.testing.assert_close(adv.outcome_token_rewards(t(2, 3, 4), mask), expected)


def test_gae_by_hand():
    mask = t([1, 1, 1, 0])
    token_rewards = t([0, 0, 1, 5])  # the 5 is padding and must be ignored
    values = t([0.5, 0.6, 0.7, 9.0])
    # gamma=1, lam=0.5: A2 = 1 - 0.7 = 0.3; A1 = (0.7 - 0.6) + 0.5*0.3 = 0.25;
    # A0 = (0.6 - 0.5) + 0.5*0.25 = 0.225; returns = A + V
    a, ret = adv.gae(token_rewards, values, mask, gamma=1.0, lam=0.5, whiten_advantages=False)
    torch.testing.assert_close(a, t([0.225, 0.25, 0.3, 0]))
    torch.testing.assert_close(ret, t([0.725, 0.85, 1.0, 0]))
    # gamma=0.9, lam=1: deltas 0.04, 0.03, 0.3; A0 = 0.04 + 0.9*0.03 + 0.81*0.3 = 0.31
    a, _ = adv.gae(token_rewards, values, mask, gamma=0.9, lam=1.0, whiten_advantages=False)
    torch.testing.assert_close(a, t([0.31, 0.3, 0.3, 0]))


def test_gae_whitening_over_valid_tokens():
    mask = t([1, 1, 1, 0])
    a, ret = adv.gae(t([0, 0, 1, 0]), t([0.5, 0.6, 0.7, 0]), mask, lam=0.5)
    # raw 0.225, 0.25, 0.3: mean 0.25833, Bessel std 0.0381881; the 1e-8 added to the
    # variance (0.00145833) shrinks these by a relative 3.4e-6
    torch.testing.assert_close(a, t([-0.8728716, -0.2182179, 1.0910895, 0]), atol=5e-6, rtol=0)
    torch.testing.assert_close(ret, t([0.725, 0.85, 1.0, 0]))


def test_whiten():
    torch.testing.assert_close(adv.whiten(t([1, 2, 3, 99]), t([1, 1, 1, 0])), t([-1, 0, 1, 0]))


def test_reinforce_pp_return_to_go():
    mask = t([1, 1, 1])
    rewards = t([0, 0, 1])
    got = adv.reinforce_pp(rewards, mask, whiten_advantages=False)
    torch.testing.assert_close(got, t([1, 1, 1]))
    torch.testing.assert_close(
        adv.reinforce_pp(rewards, mask, gamma=0.5, whiten_advantages=False), t([0.25, 0.5, 1])
    )


def test_reinforce_pp_baseline_subtracts_group_mean():
    mask = t([1, 1], [1, 0])
    # centred rewards 0.5, -0.5 on the last valid tokens; return-to-go with gamma = 1
    got = adv.reinforce_pp_baseline(t(1, 0), 2, mask, whiten_advantages=False)
    torch.testing.assert_close(got, t([0.5, 0.5], [-0.5, 0]))
    penalty = t([0.1, 0.2], [0.3, 9.0])  # per-token beta*KL; padding ignored
    got = adv.reinforce_pp_baseline(
        t(1, 0), 2, mask, token_penalty=penalty, whiten_advantages=False
    )
    torch.testing.assert_close(got, t([0.2, 0.3], [-0.8, 0]))
