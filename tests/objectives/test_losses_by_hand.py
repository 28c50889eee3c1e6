"""Surrogates, aggregation, KL, entropy and value loss on cases worked out by hand."""

import math

import pytest
import torch

from postrl.objectives import (
    BatchCounts,
    Diagnostics,
    PolicyLossConfig,
    PolicyLossInputs,
    aggregate,
    clipped_value_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    surrogates,
)
from postrl.objectives.ratios import entropy_mixing_weight


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def leaf(*rows):
    return t(*rows).requires_grad_(True)


def test_token_surrogate_clip_higher_and_gradients():
    # ratios 1.5, 0.5, 1.1 with advantages +1, -1, +1 and eps 0.2 / 0.28:
    # 1.5 is clipped to 1.28 (high), 0.5 to 0.8 (low: min(-0.5, -0.8) = -0.8), 1.1 is free
    logp = leaf([math.log(1.5), math.log(0.5), math.log(1.1)])
    old, mask, adv = t([0.0, 0.0, 0.0]), t([1, 1, 1]), t([1.0, -1.0, 1.0])
    out = surrogates.token(logp, old, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(out.psi, t([1.28, -0.8, 1.1]))
    assert out.clipped_high.tolist() == [[True, False, False]]
    assert out.clipped_low.tolist() == [[False, True, False]]
    out.psi.sum().backward()
    torch.testing.assert_close(logp.grad, t([0.0, 0.0, 1.1]))  # d(r*A)/dlogp = r*A


def test_dual_clip_bounds_negative_advantages():
    # r = 4, A = -1: min(-4, -1.2) = -4, dual-clip c = 3 raises it to -3 (no gradient)
    logp = leaf([math.log(4.0), math.log(2.0)])
    old, mask, adv = t([0.0, 0.0]), t([1, 1]), t([-1.0, -1.0])
    out = surrogates.token(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(out.psi, t([-3.0, -2.0]))
    assert out.dual_clipped.tolist() == [[True, False]]
    out.psi.sum().backward()
    torch.testing.assert_close(logp.grad, t([0.0, -2.0]))


def test_sequence_surrogate_clips_per_response():
    # token log-ratios 0.2 and -0.1: log s = 0.05, s = 1.0512711
    logp, old, mask = leaf([0.2, -0.1, 7.0]), t([0.0, 0.0, 0.0]), t([1, 1, 0])
    up = surrogates.sequence(logp, old, t([1.0, 1.0, 1.0]), mask, 3e-4, 4e-4)
    torch.testing.assert_close(up.psi[0, :2], t(1.0004, 1.0004))  # clipped high, no gradient
    assert up.clipped_high[0, :2].all()
    down = surrogates.sequence(logp, old, t([-1.0, -1.0, -1.0]), mask, 3e-4, 4e-4)
    torch.testing.assert_close(down.psi[0, :2], t(-1.0512711, -1.0512711))
    # seq_mean_token_mean of -psi over one response is s; ds/dlogp_t = s / L = 0.5256355
    loss = aggregate(-down.psi, mask, "seq_mean_token_mean", BatchCounts.of(mask))
    loss.backward()
    torch.testing.assert_close(logp.grad, t([0.5256355, 0.5256355, 0.0]))


def test_hybrid_clips_each_branch_before_mixing():
    # r = e^0.2 = 1.2214028, e^-0.1 = 0.9048374; s = 1.0512711; A = 1; w = 1/2
    # t0: z = 1.1363369, z_clip = (1.2214028 + 1.0004) / 2 = 1.1109014 -> psi = 1.1109014
    # t1: z = 0.9780543, z_clip = (0.9048374 + 1.0004) / 2 = 0.9526187 -> psi = 0.9526187
    logp, old, mask, adv = leaf([0.2, -0.1]), t([0.0, 0.0]), t([1, 1]), t([1.0, 1.0])
    out = surrogates.hybrid(logp, old, adv, mask, 0.5, 0.2, 0.28, 3e-4, 4e-4)
    torch.testing.assert_close(out.psi, t([1.1109014, 0.9526187]))
    out.psi.sum().backward()
    # only the sequence branch is clipped: each token keeps w * r of gradient
    torch.testing.assert_close(logp.grad, t([0.6107014, 0.4524187]))


def test_geometric_clips_in_log_space_pessimistically():
    logp, old, mask = t([0.6, -0.1]), t([0.0, 0.0]), t([1, 1])
    # A > 0: min(log r, clip) = 0.4, -0.1 -> mean 0.15 -> psi = e^0.15 = 1.1618342
    up = surrogates.geometric(logp, old, t([1.0, 1.0]), mask, 0.4, 0.4)
    torch.testing.assert_close(up.psi, t([1.1618342, 1.1618342]))
    # A < 0: max(log r, clip) keeps 0.6 -> mean 0.25 -> psi = -e^0.25 = -1.2840254
    down = surrogates.geometric(logp, old, t([-1.0, -1.0]), mask, 0.4, 0.4)
    torch.testing.assert_close(down.psi, t([-1.2840254, -1.2840254]))
    assert up.clipped_high.tolist() == [[True, False]] and not down.clipped_low.any()


def test_cispo_truncates_the_weight_not_the_gradient():
    # r = e^0.5 = 1.6487 > 1.28: weight 1.28; psi = 1.28 * A * logp = 1.28 * 1 * -1
    logp, old, mask = leaf([-1.0]), t([-1.5]), t([1])
    out = surrogates.cispo(logp, old, t([1.0]), mask, 0.28)
    torch.testing.assert_close(out.psi, t([-1.28]))
    out.psi.sum().backward()
    torch.testing.assert_close(logp.grad, t([1.28]))
    assert out.clipped_high.all()


def test_aggregation_modes():
    values = t([1, 2, 3], [4, 0, 0], [7, 7, 7])
    mask = t([1, 1, 1], [1, 0, 0], [0, 0, 0])  # the empty response is not counted in N
    counts = BatchCounts.of(mask)
    assert counts == BatchCounts(tokens=4, responses=2)
    assert aggregate(values, mask, "token_mean", counts).item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq_mean_token_mean", counts).item() == pytest.approx(
        (6 / 3 + 4 / 1) / 2
    )
    assert aggregate(values, mask, "seq_mean_token_sum", counts).item() == pytest.approx(10 / 2)
    assert aggregate(values, mask, "seq_mean_token_sum_norm", counts, 5).item() == pytest.approx(1)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(values, mask, "seq_mean_token_sum_norm", counts)


def test_kl_estimators():
    logp, ref = t([-1.0]), t([-1.5])  # log_ratio = ref - logp = -0.5
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5)  # 0.1065307
    # near the reference, float32 must not cancel k3 = x^2/2 + x^3/6 + ... to zero
    small = kl_penalty(torch.tensor([0.0]), torch.tensor([1e-4]), "k3")
    assert small.item() == pytest.approx(5.0002e-9, rel=1e-3)
    # log_ratio -30 is clamped to -20 (k3 = e^-20 + 19), then k3 to 10; the gradient is 0
    far = leaf([0.0])
    k3 = kl_penalty(far, t([-30.0]), "k3")
    assert k3.item() == 10.0
    k3.sum().backward()
    assert far.grad.item() == 0.0


def test_entropy_from_logits():
    logits = t([0.0, 0.0], [0.0, math.log(3.0)])  # probabilities 1/2,1/2 and 1/4,3/4
    torch.testing.assert_close(entropy_from_logits(logits), t(0.6931472, 0.5623351))


def test_entropy_mixing_weight_min_max_per_response():
    entropy = t([1.0, 3.0, 2.0, 50.0], [4.0, 0.0, 0.0, 0.0])
    mask = t([1, 1, 1, 0], [1, 0, 0, 0])
    # row 0: (H - 1) / 2 over its valid tokens; row 1: one token -> averaged mixing 1/2
    torch.testing.assert_close(
        entropy_mixing_weight(entropy, mask), t([0.0, 1.0, 0.5, 0.0], [0.5, 0.0, 0.0, 0.0])
    )


def test_clipped_value_loss():
    # V = 1.0, V_old = 0.5, G = 1.5, eps = 0.2: plain (1 - 1.5)^2 = 0.25;
    # clipped V = 0.7 -> (0.7 - 1.5)^2 = 0.64; loss = 0.64 / 2 = 0.32 (clipped)
    # V = 1.4, V_old = 1.3, G = 1.5: inside the range, loss = 0.01 / 2 = 0.005
    loss, clipped = clipped_value_loss(t([1.0, 1.4]), t([0.5, 1.3]), t([1.5, 1.5]), 0.2)
    torch.testing.assert_close(loss, t([0.32, 0.005]))
    assert clipped.tolist() == [[True, False]]


def test_policy_loss_total_and_diagnostics_by_hand():
    # the token example above (psi = 1.28, -0.8, 1.1) plus k3 KL in the loss with beta = 0.1
    # (log_ratio = -0.5 on every token: k3 = 0.1065307) and an entropy bonus 0.01 * H (H = 1)
    logp = leaf([math.log(1.5), math.log(0.5), math.log(1.1)])
    batch = PolicyLossInputs(
        logp=logp, old_logp=t([0.0, 0.0, 0.0]), advantages=t([1.0, -1.0, 1.0]),
        response_mask=t([1, 1, 1]), ref_logp=logp.detach() - 0.5,
        entropy=t([1.0, 1.0, 1.0]),
    )
    cfg = PolicyLossConfig(ratio="token", clip_low=0.2, clip_high=0.28, aggregation="token_mean",
                           kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    out = policy_loss(batch, cfg, BatchCounts(tokens=3, responses=1))
    k3 = math.exp(-0.5) - 0.5
    policy = -(1.28 - 0.8 + 1.1) / 3  # -0.5266667
    assert out.loss.item() == pytest.approx(policy + 0.1 * k3 - 0.01)
    metrics = out.diagnostics.finish()
    assert metrics["loss/per_token"] == pytest.approx(policy)
    assert metrics["loss/per_response"] == pytest.approx(policy)  # one response
    assert metrics["kl/mean"] == pytest.approx(k3)
    assert metrics["clip/low_frac"] == pytest.approx(1 / 3)
    assert metrics["clip/high_frac"] == pytest.approx(1 / 3)
    assert metrics["ratio/mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert (metrics["ratio/min"], metrics["ratio/max"]) == pytest.approx((0.5, 1.5))
    # token log-ratios ln1.5, ln0.5, ln1.1 (population std over the response)
    logs = [math.log(1.5), math.log(0.5), math.log(1.1)]
    mean = sum(logs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert metrics["ratio/token_logratio_std"] == pytest.approx(std)
    assert metrics["ratio/seq_std"] == pytest.approx(0.0, abs=1e-12)  # one response


def test_per_token_and_per_response_objectives_differ_with_lengths():
    # two responses on-policy (r = 1): psi = A. Lengths 1 and 3, advantages +1 and -1.
    # per token: -(1 - 3) / 4 = 0.5; per response: -(1 - 1) / 2 = 0
    logp = t([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    batch = PolicyLossInputs(logp, logp, t(1.0, -1.0), t([1, 0, 0], [1, 1, 1]))
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        out = policy_loss(batch, PolicyLossConfig(aggregation=aggregation), BatchCounts(4, 2))
        metrics = out.diagnostics.finish()
        assert metrics["loss/per_token"] == pytest.approx(0.5)
        assert metrics["loss/per_response"] == pytest.approx(0.0)
        assert metrics["loss/policy"] == pytest.approx(0.5 if aggregation == "token_mean" else 0)


def test_diagnostics_merge_sums_mins_maxes_and_stds():
    a, b = Diagnostics(), Diagnostics()
    a.add("x", 0.25), b.add("x", 0.5)
    a.low("m", 2.0), b.low("m", 1.0)
    a.high("M", 2.0), b.high("M", 3.0)
    a.add_std("s", 0.5, 0.5), b.add_std("s", 0.5, 1.5)  # E[x] = 1, E[x^2] = 2: std = 1
    assert a.merge(b).finish() == {"x": 0.75, "m": 1.0, "M": 3.0, "s": 1.0}


def test_missing_inputs_are_named():
    logp = t([0.0])
    batch = PolicyLossInputs(logp, logp, t(1.0), t([1]))
    with pytest.raises(ValueError, match="reference log-probs"):
        policy_loss(batch, PolicyLossConfig(kl_coef=0.1), BatchCounts(1, 1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(batch, PolicyLossConfig(entropy_coef=0.1), BatchCounts(1, 1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(batch, PolicyLossConfig(ratio="hybrid", hybrid_mixing="entropy"),
                    BatchCounts(1, 1))


def test_sapo_gate_is_the_policy_gradient_at_ratio_one_and_fades_away_from_it():
    """psi = (4/tau) sigmoid(tau (r - 1)) A: d psi / d logp = 4 s (1 - s) r A, which is A at
    r = 1 for any tau; tau_neg > tau_pos makes negative advantages fade faster."""
    logp = leaf([0.0, math.log(2.0), 0.0, math.log(2.0)])
    old, mask, adv = t([0.0, 0.0, 0.0, 0.0]), t([1, 1, 1, 1]), t([1.0, 1.0, -1.0, -1.0])
    out = surrogates.sapo(logp, old, adv, mask, 1.0, 1.05)
    out.psi.sum().backward()
    s_pos, s_neg = torch.sigmoid(t(1.0)), torch.sigmoid(t(1.05))
    torch.testing.assert_close(out.psi, t([2.0, 4 * s_pos.item(), -2 / 1.05,
                                           -4 / 1.05 * s_neg.item()]))
    grad_pos = 4 * s_pos * (1 - s_pos) * 2.0
    grad_neg = -4 * s_neg * (1 - s_neg) * 2.0
    torch.testing.assert_close(logp.grad, t([1.0, grad_pos.item(), -1.0, grad_neg.item()]))
    assert abs(grad_neg.item()) < grad_pos.item() < 2.0  # a plain PG would weigh r = 2 fully
    assert not out.clipped_low.any() and not out.clipped_high.any()


def test_dppo_masks_only_moves_beyond_delta_in_the_advantages_direction():
    """Binary TV with delta 0.1: p_old = 0.5 for every token; p = 0.7 (rose by 0.2), 0.55,
    0.3 (fell by 0.2), 0.3 again with A > 0 (falling is not the direction A pushes)."""
    logp = leaf([math.log(0.7), math.log(0.55), math.log(0.3), math.log(0.3)])
    old = t([math.log(0.5)] * 4)
    mask, adv = t([1, 1, 1, 1]), t([1.0, 1.0, -1.0, 1.0])
    out = surrogates.dppo(logp, old, adv, mask, 0.1, 0.1, "tv")
    assert out.clipped_high.tolist() == [[True, False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, True, False]]
    out.psi.sum().backward()
    torch.testing.assert_close(out.psi, t([0.0, 1.1, 0.0, 0.6]))
    torch.testing.assert_close(logp.grad, t([0.0, 1.1, 0.0, 0.6]))  # sg(r) * A * grad logp
    kl = surrogates.binary_divergence(logp, old, "kl")
    expected = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    assert kl[0, 0].item() == pytest.approx(expected, rel=1e-6)
