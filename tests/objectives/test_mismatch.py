"""The sampler-trainer mismatch correction against its formulas: weights in each unit,
truncation, masking, rejection, the gradient they leave, and diagnostics that merge exactly."""

import math

import pytest
import torch

from postrl.errors import ConfigError
from postrl.objectives import (
    BatchCounts,
    Diagnostics,
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
)
from postrl.objectives.mismatch import correct, log_weights, mismatch_kl
from postrl.recipes import get_recipe


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


# two responses: three valid tokens, then two and a pad
OLD = t([-1.0, -2.0, -0.5], [-0.3, -1.2, 9.0])
SAMPLER = t([-1.5, -1.0, -0.5], [-0.1, -1.0, -7.0])
MASK = t([1, 1, 1], [1, 1, 0]).bool()
GAP = OLD - SAMPLER  # 0.5, -1, 0 | -0.2, -0.2, (pad)


def test_log_weights_in_each_unit():
    token, _ = log_weights(OLD, SAMPLER, MASK, "token")
    torch.testing.assert_close(token, t([0.5, -1.0, 0.0], [-0.2, -0.2, 0.0]))
    product, bounded = log_weights(OLD, SAMPLER, MASK, "sequence_product")
    torch.testing.assert_close(product, t([-0.5, -0.5, -0.5], [-0.4, -0.4, 0.0]))
    assert not bounded.any()
    geometric, _ = log_weights(OLD, SAMPLER, MASK, "sequence_geometric")
    torch.testing.assert_close(geometric, t([-0.5 / 3] * 3, [-0.2, -0.2, 0.0]))


def test_a_product_weight_beyond_exp_20_is_bounded_and_counted():
    long_gap = torch.full((1, 50), -0.5, dtype=torch.float64)  # sum -25: exp underflows
    log_w, bounded = log_weights(long_gap, torch.zeros(1, 50), torch.ones(1, 50),
                                 "sequence_product")
    assert bounded.tolist() == [True] and log_w.min().item() == -20.0


def test_truncation_caps_at_c_and_says_where():
    out = correct(OLD, SAMPLER, MASK, "token", "truncate", 1.5, 0.5, 2.0, None)
    raw = torch.exp(GAP).masked_fill(~MASK, 0.0)
    torch.testing.assert_close(out.raw, raw)
    torch.testing.assert_close(out.weight, raw.clamp(max=1.5))
    assert out.truncated.tolist() == [[True, False, False], [False, False, False]]
    assert not out.masked.any() and not out.rejected.any()


def test_masking_zeroes_weights_outside_the_bounds_on_both_sides():
    out = correct(OLD, SAMPLER, MASK, "token", "mask", 2.0, 0.5, 1.5, None)
    # exp(0.5)=1.65 > 1.5 and exp(-1)=0.37 < 0.5 are masked; exp(0)=1 and exp(-0.2)=0.82 kept
    assert out.masked.tolist() == [[True, True, False], [False, False, False]]
    torch.testing.assert_close(out.weight, t([0.0, 0.0, 1.0], [math.exp(-0.2)] * 2 + [0.0]))


def test_sequence_rejection_zeroes_whole_responses_by_their_geometric_weight():
    # geometric weights exp(-1/6) = 0.846 and exp(-0.2) = 0.819; b = 1.2 rejects only the second
    out = correct(OLD, SAMPLER, MASK, "none", "truncate", 2.0, 0.5, 2.0, 1.2)
    assert out.rejected.tolist() == [False, True]
    torch.testing.assert_close(out.weight, t([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]))


def test_mismatch_kl_estimators():
    k1, k3 = mismatch_kl(OLD, SAMPLER)
    torch.testing.assert_close(k1, SAMPLER - OLD)
    torch.testing.assert_close(k3, torch.exp(GAP) - GAP - 1)
    assert (k3 >= 0).all()
    same_k1, same_k3 = mismatch_kl(OLD, OLD)
    assert not same_k1.any() and not same_k3.any()


def loss_cfg(**mismatch) -> PolicyLossConfig:
    return PolicyLossConfig(aggregation="token_mean", clip_low=0.2, clip_high=0.2, **mismatch)


def test_the_gradient_is_the_uncorrected_one_times_the_weight():
    """One update per batch (old = logp): d loss / d logp[i,t] = -w[i,t] * A_i / T."""
    logp = OLD.clone().requires_grad_(True)
    advantages = t(1.0, -2.0)
    counts = BatchCounts.of(MASK)
    cfg = loss_cfg(mismatch_weight="token", mismatch_mode="truncate", mismatch_cap=1.5)
    inputs = PolicyLossInputs(logp, logp.detach(), advantages, MASK, sampler_logp=SAMPLER)
    policy_loss(inputs, cfg, counts).loss.backward()
    weight = torch.exp(GAP).clamp(max=1.5).masked_fill(~MASK, 0.0)
    expected = -weight * advantages.unsqueeze(1) / MASK.sum()
    torch.testing.assert_close(logp.grad, expected)
    # off: the same loss without weights, and the sampler's log-probs change nothing
    plain = OLD.clone().requires_grad_(True)
    policy_loss(PolicyLossInputs(plain, plain.detach(), advantages, MASK, sampler_logp=SAMPLER),
                loss_cfg(), counts).loss.backward()
    torch.testing.assert_close(plain.grad, -MASK.double() * advantages.unsqueeze(1) / MASK.sum())


def test_a_correction_without_the_samplers_log_probs_is_refused():
    cfg = loss_cfg(mismatch_weight="token")
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        policy_loss(PolicyLossInputs(OLD, OLD, t(1.0, 1.0), MASK), cfg, BatchCounts.of(MASK))


def test_diagnostics_of_micro_batches_merge_into_the_whole_batch():
    cfg = loss_cfg(mismatch_weight="sequence_geometric", mismatch_mode="mask",
                   mismatch_low=0.9, mismatch_high=1.1, mismatch_reject=1.19)
    counts = BatchCounts.of(MASK)
    advantages = t(1.0, -1.0)

    def diagnostics(rows) -> Diagnostics:
        inputs = PolicyLossInputs(OLD[rows], OLD[rows], advantages[rows], MASK[rows],
                                  sampler_logp=SAMPLER[rows])
        return policy_loss(inputs, cfg, counts).diagnostics

    whole = diagnostics(slice(0, 2)).finish()
    split = diagnostics(slice(0, 1)).merge(diagnostics(slice(1, 2))).finish()
    assert whole.keys() == split.keys()
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    tokens = 5
    assert whole["mismatch/kl_k1"] == pytest.approx(float((SAMPLER - OLD)[MASK].sum()) / tokens)
    assert whole["mismatch/sampler_ppl"] == pytest.approx(math.exp(-SAMPLER[MASK].sum() / tokens))
    assert whole["mismatch/trainer_ppl"] == pytest.approx(math.exp(-OLD[MASK].sum() / tokens))
    # geometric weights 0.846 (3 tokens, masked: below 0.9) and 0.819 (rejected: b = 1.19)
    assert whole["mismatch/masked_frac"] == pytest.approx(1.0)
    assert whole["mismatch/rejected_frac"] == pytest.approx(0.5)
    assert whole["mismatch/weight_max"] == 0.0
    raw = torch.tensor([math.exp(-0.5 / 3)] * 3 + [math.exp(-0.2)] * 2)
    ess = float(raw.sum() ** 2 / (tokens * raw.square().sum()))
    assert whole["mismatch/ess"] == pytest.approx(ess)


@pytest.mark.parametrize("override, message", [
    ({"mismatch_weight": "sequence"}, "mismatch_weight='sequence' is not one of"),
    ({"mismatch_mode": "clip"}, "mismatch_mode='clip' is not one of"),
    ({"mismatch_cap": 0.5}, "mismatch_cap must be >= 1"),
    ({"mismatch_low": 1.2}, "0 <= mismatch_low < 1 < mismatch_high"),
    ({"mismatch_reject": 1.0}, "mismatch_reject b must be > 1"),
])
def test_impossible_corrections_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        get_recipe("grpo").with_(**override)


def areal_decoupled_loss(logp, proximal, behaviour, advantages, mask, eps_low, eps_high, cap):
    """AReaL's decoupled PPO objective (inclusionAI/AReaL's ``ppo_actor_loss_fn`` with
    ``use_decoupled_loss`` and ``behav_imp_weight_cap``, written out here from its formula):
    the clipped surrogate of
    pi / pi_prox, times pi_prox / pi_behav where that weight is at most ``cap`` and 0 where
    it is above, summed over the valid tokens and divided by their count."""
    ratio = torch.exp(logp - proximal)
    surrogate = torch.max(-advantages * ratio,
                          -advantages * ratio.clamp(1 - eps_low, 1 + eps_high))
    weight = torch.exp(proximal - behaviour)
    weight = torch.where((weight <= cap) & mask, weight, 0.0)
    return torch.where(mask, surrogate * weight, 0.0).sum() / mask.sum()


def test_decoupled_ppo_is_the_proximal_ratio_with_an_upper_mask_as_areal_computes_it():
    """old_policy=proximal with mismatch_weight=token, mismatch_mode=mask, mismatch_low=0 and
    mismatch_high=cap, under token_mean, is AReaL's decoupled objective: loss and gradient."""
    torch.manual_seed(0)
    mask = torch.rand(4, 7) < 0.8
    behaviour = -torch.rand(4, 7, dtype=torch.float64) * 3
    proximal = behaviour + torch.randn(4, 7, dtype=torch.float64) * 0.8  # stale samples
    logp = (proximal + torch.randn(4, 7, dtype=torch.float64) * 0.3).requires_grad_()
    advantages = torch.randn(4, dtype=torch.float64)
    cap = 2.0
    recipe = get_recipe("dapo").with_(mismatch_weight="token", mismatch_mode="mask",
                                      mismatch_low=0.0, mismatch_high=cap)
    cfg = recipe.policy_loss_config(7)
    assert (cfg.aggregation, cfg.ratio, cfg.dual_clip) == ("token_mean", "token", None)
    ours = policy_loss(PolicyLossInputs(logp, proximal, advantages, mask,
                                        sampler_logp=behaviour), cfg, BatchCounts.of(mask)).loss
    (grad_ours,) = torch.autograd.grad(ours, logp)
    theirs = areal_decoupled_loss(logp, proximal, behaviour,
                                  advantages[:, None].expand(4, 7), mask, cfg.clip_low,
                                  cfg.clip_high, cap)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    assert (torch.exp(proximal - behaviour)[mask] > cap).any()  # the mask did something
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)
