"""Identities the components must satisfy (docs/algorithms.md §1–§3, §7)."""

import pytest
import torch

from postrl.objectives import (
    AGGREGATIONS,
    BatchCounts,
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
    surrogates,
)
from postrl.objectives import advantages as adv
from postrl.recipes import get_recipe


def random_batch(seed: int, n: int = 6, length: int = 7, off_policy: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n,), generator=gen)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).double()
    logp = -torch.rand(n, length, generator=gen, dtype=torch.float64) * 3
    old = logp + off_policy * torch.randn(n, length, generator=gen, dtype=torch.float64)
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    entropy = torch.rand(n, length, generator=gen, dtype=torch.float64) * 2
    return logp, old, mask, rewards, entropy


def loss_and_grad(logp, old, mask, advantages, cfg, entropy=None):
    leaf = logp.clone().requires_grad_(True)
    out = policy_loss(PolicyLossInputs(leaf, old, advantages, mask, entropy=entropy), cfg,
                      BatchCounts.of(mask))
    out.loss.backward()
    return out.loss.detach(), leaf.grad


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_policy_token_sequence_hybrid_give_identical_gradients(aggregation, seed):
    logp, _, mask, rewards, entropy = random_batch(seed)
    advantages = adv.group(rewards, 3)
    reference = None
    for ratio in ("token", "sequence", "sequence_token", "hybrid"):
        cfg = PolicyLossConfig(ratio=ratio, aggregation=aggregation, norm_constant=7.0,
                               clip_low=3e-4, clip_high=4e-4)
        loss, grad = loss_and_grad(logp, logp, mask, advantages, cfg, entropy)
        if reference is None:
            reference = (loss, grad)
        torch.testing.assert_close(loss, reference[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, reference[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_policy_entropy_guided_hybrid_reweights_tokens_within_a_response(seed):
    """With a per-token weight w, d z_t / d logp_u = w_t*[t = u] + (1 - w_t)/L on-policy, so
    token u gets w_u + 1 - mean(w) times its token-level gradient: the same total per response,
    shifted towards high-entropy tokens. Unlike averaged mixing, entropy-guided DHPO is NOT
    equivalent to the token surrogate on-policy (docs/algorithms.md §7)."""
    from postrl.objectives.ratios import entropy_mixing_weight

    logp, _, mask, rewards, entropy = random_batch(seed)
    advantages = adv.group(rewards, 3)
    token_cfg = PolicyLossConfig(ratio="token", aggregation="token_mean")
    hybrid_cfg = PolicyLossConfig(ratio="hybrid", hybrid_mixing="entropy", aggregation="token_mean")
    _, token_grad = loss_and_grad(logp, logp, mask, advantages, token_cfg)
    _, hybrid_grad = loss_and_grad(logp, logp, mask, advantages, hybrid_cfg, entropy)
    weight = entropy_mixing_weight(entropy, mask)
    mean_weight = weight.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True)
    expected = token_grad * (weight + 1 - mean_weight) * mask
    torch.testing.assert_close(hybrid_grad, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(hybrid_grad.sum(dim=1), token_grad.sum(dim=1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_weight_one_is_token_and_zero_is_sequence(seed):
    logp, old, mask, rewards, _ = random_batch(seed, off_policy=0.3)
    advantages = adv.group(rewards, 3).unsqueeze(1).expand_as(logp) * mask

    def psi_and_grad(fn):
        leaf = logp.clone().requires_grad_(True)
        psi = fn(leaf) * mask
        psi.sum().backward()
        return psi.detach(), leaf.grad

    cases = [
        (lambda x: surrogates.hybrid(x, old, advantages, mask, 1.0, 0.2, 0.28, 3e-4, 4e-4).psi,
         lambda x: surrogates.token(x, old, advantages, mask, 0.2, 0.28).psi),
        (lambda x: surrogates.hybrid(x, old, advantages, mask, 0.0, 0.2, 0.28, 3e-4, 4e-4).psi,
         lambda x: surrogates.sequence(x, old, advantages, mask, 3e-4, 4e-4).psi),
    ]
    for hybrid_fn, pure_fn in cases:
        for got, want in zip(psi_and_grad(hybrid_fn), psi_and_grad(pure_fn), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dr_grpo_advantage_is_the_group_mean_centred_reward(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(12, generator=gen, dtype=torch.float64)
    recipe = get_recipe("dr_grpo")
    got = adv.group(rewards, 4, scale=recipe.adv_scale, std=recipe.adv_std, eps=recipe.adv_eps)
    grouped = rewards.view(3, 4)
    torch.testing.assert_close(got, (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1))


@pytest.mark.parametrize("ratio", ["token", "sequence", "sequence_token", "hybrid", "geometric",
                                   "cispo"])
@pytest.mark.parametrize("advantage", ["group", "rloo"])
def test_zero_variance_groups_get_zero_advantage_and_zero_gradient(ratio, advantage):
    logp, old, mask, _, entropy = random_batch(3, off_policy=0.2)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 0.5], dtype=torch.float64)  # group 2 flat
    advantages = adv.group(rewards, 3) if advantage == "group" else adv.rloo(rewards, 3)
    assert torch.equal(advantages[3:], torch.zeros(3, dtype=torch.float64))
    assert advantages[:3].abs().min() > 0
    cfg = PolicyLossConfig(ratio=ratio, aggregation="token_mean")
    _, grad = loss_and_grad(logp, old, mask, advantages, cfg, entropy)
    assert torch.equal(grad[3:], torch.zeros_like(grad[3:]))
    assert grad[:3].abs().sum() > 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_token_equals_sequence_with_per_response_advantages(aggregation, seed):
    logp, old, mask, rewards, _ = random_batch(seed, off_policy=0.2)
    advantages = adv.group(rewards, 3)
    results = []
    for ratio in ("sequence", "sequence_token"):
        cfg = PolicyLossConfig(ratio=ratio, aggregation=aggregation, norm_constant=7.0,
                               clip_low=0.05, clip_high=0.05)
        results.append(loss_and_grad(logp, old, mask, advantages, cfg))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-12)
