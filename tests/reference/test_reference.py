"""Property tests: the vectorised ``postrl.objectives`` against the naive loops of ``naive.py``.

Hypothesis draws the shapes, masks (lengths 0 to T, so length-1 and fully masked responses
occur), options and a seed; the float tensors come from that seed (float64). Masked positions
hold unrelated values, which must never matter. Values, gradients and diagnostics must agree
to 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import Tensor

from postrl.objectives import (
    AGGREGATIONS,
    RATIO_UNITS,
    BatchCounts,
    PolicyLossConfig,
    PolicyLossInputs,
    advantages,
    policy_loss,
    surrogates,
)
from postrl.objectives.policy_loss import NOT_PPO_CLIPPED

from . import naive

TOL = 1e-6
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOSS_SETTINGS = settings(SETTINGS, max_examples=100)
F64 = torch.float64


def close(actual: Tensor | float, expected: Tensor | float, what: str) -> None:
    """Assert agreement to ``TOL`` (absolute and relative)."""
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64),
        torch.as_tensor(expected, dtype=F64),
        atol=TOL,
        rtol=TOL,
        msg=lambda m: f"{what}: {m}",
    )


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def masks(draw: st.DrawFn, min_tokens: int = 1, n: int | None = None) -> Tensor:
    """A response-aligned ``[N, T]`` 0/1 mask of random lengths with at least ``min_tokens``."""
    if n is None:
        n = draw(st.integers(1, 6))
    t_max = draw(st.integers(-(-min_tokens // n), 7))
    lengths = draw(st.lists(st.integers(0, t_max), min_size=n, max_size=n))
    i = 0
    while sum(lengths) < min_tokens:  # top up the first responses until there are enough tokens
        lengths[i % n] = min(t_max, lengths[i % n] + 1)
        i += 1
    positions = torch.arange(t_max).expand(n, t_max)
    return (positions < torch.tensor(lengths).unsqueeze(1)).to(F64)


def generator(draw: st.DrawFn) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))


def outcome_rewards(draw: st.DrawFn, n: int) -> Tensor:
    """Rewards from a small set, so zero-variance groups occur, or spread out."""
    if draw(st.booleans()):
        values = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    else:
        values = draw(st.lists(st.integers(-8, 8), min_size=n, max_size=n))
        values = [v / 4 for v in values]
    return torch.tensor(values, dtype=F64)


@dataclass
class LossCase:
    mask: Tensor
    logp: Tensor
    old_logp: Tensor
    ref_logp: Tensor
    entropy: Tensor
    advantages: Tensor
    cfg: naive.LossConfig


@st.composite
def loss_cases(draw: st.DrawFn, ratio: str) -> LossCase:
    mask = draw(masks())
    n, t_max = mask.shape
    g = generator(draw)

    def randn() -> Tensor:
        return torch.randn(n, t_max, generator=g, dtype=F64)

    def rand() -> Tensor:
        return torch.rand(n, t_max, generator=g, dtype=F64)

    valid = mask.bool()
    spread = draw(st.sampled_from([0.3, 1.0, 0.05, 1e-4, 0.0]))  # size of logp - old
    logp = torch.where(valid, -3.0 * rand(), -5.0 * rand())
    # log-probs, so never above 0 (DPPO's binary KL needs probabilities <= 1)
    old_logp = torch.where(valid, (logp + spread * randn()).clamp(max=0.0), -5.0 * rand())
    ref_spread = draw(st.sampled_from([0.1, 1.0, 3.0]))  # 3.0 reaches the k3 clamp
    ref_logp = torch.where(valid, logp + ref_spread * randn(), -5.0 * rand())
    entropy = 2.0 * rand()
    if draw(st.booleans()):
        entropy = torch.round(entropy, decimals=1)  # ties, so min == max happens

    per_token = ratio != "geometric" and draw(st.booleans())
    adv = randn() if per_token else torch.randn(n, generator=g, dtype=F64)
    adv = adv * (torch.rand(adv.shape, generator=g) > 0.2)  # some zero advantages

    tiny = (3e-4, 4e-4)
    clip_low, clip_high = draw(st.sampled_from([(0.2, 0.2), (0.2, 0.28), tiny]))
    seq_low, seq_high = draw(st.sampled_from([tiny, (0.2, 0.28)]))
    cfg = naive.LossConfig(
        ratio=ratio,
        clip_low=clip_low,
        clip_high=clip_high,
        seq_clip_low=seq_low,
        seq_clip_high=seq_high,
        hybrid_mixing=draw(st.sampled_from(["averaged", "entropy"])),
        dual_clip=(None if ratio in NOT_PPO_CLIPPED  # PPO-clipped units only
                   else draw(st.sampled_from([None, 1.5, 3.0]))),
        aggregation=draw(st.sampled_from(AGGREGATIONS)),
        norm_constant=float(draw(st.integers(1, 16))),
        kl_coef=draw(st.sampled_from([0.0, 0.04, 0.5])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, 0.3])),
    )
    return LossCase(mask, logp, old_logp, ref_logp, entropy, adv, cfg)


def vectorised_config(cfg: naive.LossConfig) -> PolicyLossConfig:
    return PolicyLossConfig(**cfg.__dict__)


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------


@dataclass
class Compared:
    """Both implementations on one case: the naive result, the vectorised loss and
    diagnostics, and each one's gradients with respect to ``logp`` and ``entropy``."""

    naive: naive.NaiveLoss
    loss: Tensor
    diagnostics: dict[str, float]
    grad: Tensor
    naive_grad: Tensor
    entropy_grad: Tensor
    naive_entropy_grad: Tensor


def gradients(loss: Tensor, *leaves: Tensor) -> list[Tensor]:
    """``d loss / d leaf``, zero where the loss does not depend on a leaf at all."""
    if not loss.requires_grad:
        return [torch.zeros_like(leaf) for leaf in leaves]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [
        torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)
    ]


def run_both(case: LossCase) -> Compared:
    logp_v = case.logp.clone().requires_grad_()
    logp_n = case.logp.clone().requires_grad_()
    ent_v = case.entropy.clone().requires_grad_()
    ent_n = case.entropy.clone().requires_grad_()
    out = policy_loss(
        PolicyLossInputs(logp_v, case.old_logp, case.advantages, case.mask, case.ref_logp, ent_v),
        vectorised_config(case.cfg),
        BatchCounts.of(case.mask),
    )
    ref = naive.policy_loss(
        logp_n, case.old_logp, case.advantages, case.mask, case.cfg, case.ref_logp, ent_n
    )
    grad_v, ent_grad_v = gradients(out.loss, logp_v, ent_v)
    grad_n, ent_grad_n = gradients(ref.loss, logp_n, ent_n)
    return Compared(ref, out.loss, out.diagnostics.finish(), grad_v, grad_n, ent_grad_v, ent_grad_n)


@pytest.mark.parametrize("ratio", RATIO_UNITS)
@LOSS_SETTINGS
@given(data=st.data())
def test_policy_loss_matches_naive(ratio: str, data: st.DataObject) -> None:
    case = data.draw(loss_cases(ratio))
    c = run_both(case)
    diag, ref = c.diagnostics, c.naive
    for key in ("clip/low_frac", "clip/high_frac", "clip/dual_frac"):
        event(f"{key} > 0" if diag[key] > 0 else f"{key} = 0")

    close(c.loss, ref.loss, "loss")
    close(c.grad, c.naive_grad, "d loss / d logp")
    assert torch.all(c.grad[~case.mask.bool()] == 0), "gradient leaked onto masked tokens"
    close(c.entropy_grad, c.naive_entropy_grad, "d loss / d entropy")
    close(diag["loss/total"], ref.loss, "loss/total")
    close(diag["loss/per_token"], ref.per_token, "loss/per_token")
    close(diag["loss/per_response"], ref.per_response, "loss/per_response")
    close(diag["ratio/mean"], ref.ratio_mean, "ratio/mean")
    close(diag["clip/token_frac"], ref.clip_token_frac, "clip/token_frac")
    if ref.clip_low_frac is not None:
        close(diag["clip/low_frac"], ref.clip_low_frac, "clip/low_frac")
        close(diag["clip/high_frac"], ref.clip_high_frac, "clip/high_frac")
        close(diag["clip/dual_frac"], ref.dual_frac, "clip/dual_frac")
    if ref.kl_mean is not None:
        close(diag["kl/mean"], ref.kl_mean, "kl/mean")
    if ref.entropy_mean is not None:
        close(diag["entropy/mean"], ref.entropy_mean, "entropy/mean")


@pytest.mark.parametrize("ratio", [u for u in RATIO_UNITS if u != "geometric"])
@SETTINGS
@given(data=st.data())
def test_per_response_advantages_equal_their_broadcast(ratio: str, data: st.DataObject) -> None:
    """``[N]`` advantages and the same values repeated over ``[N, T]`` give the same results."""
    case = data.draw(loss_cases(ratio))
    if case.advantages.dim() == 2:
        case.advantages = case.advantages[:, 0].clone()
    per_response = run_both(case)
    case.advantages = case.advantages.unsqueeze(1).expand_as(case.mask).clone()
    per_token = run_both(case)
    close(per_token.loss, per_response.loss, "loss")
    close(per_token.grad, per_response.grad, "d loss / d logp")
    for key, value in per_response.diagnostics.items():
        close(per_token.diagnostics[key], value, key)


@SETTINGS
@given(data=st.data())
def test_sequence_token_equals_sequence_for_per_response_advantages(data: st.DataObject) -> None:
    """GSPO-token has GSPO's value and gradient when A is per response (Zheng et al. 2025 §4.3)."""
    case = data.draw(loss_cases("sequence"))
    if case.advantages.dim() == 2:
        case.advantages = case.advantages[:, 0].clone()
    sequence = run_both(case)
    case.cfg = naive.LossConfig(**{**case.cfg.__dict__, "ratio": "sequence_token"})
    sequence_token = run_both(case)
    close(sequence_token.loss, sequence.loss, "loss")
    close(sequence_token.grad, sequence.grad, "d loss / d logp")


@SETTINGS
@given(data=st.data())
def test_hybrid_endpoints_are_token_and_sequence(data: st.DataObject) -> None:
    """DHPO's mixture with ``w = 1`` is the token surrogate and with ``w = 0`` the sequence one."""
    case = data.draw(loss_cases("hybrid"))
    c = case.cfg
    adv = case.advantages
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(case.mask)
    args = (case.old_logp, adv, case.mask)
    valid = case.mask.bool()

    def psi_and_grad(make) -> tuple[Tensor, Tensor]:
        logp = case.logp.clone().requires_grad_()
        psi = make(logp).psi
        (psi * case.mask).sum().backward()
        return psi[valid], logp.grad

    for weight, make_reference in [
        (1.0, lambda lp: surrogates.token(lp, *args, c.clip_low, c.clip_high, c.dual_clip)),
        (
            0.0,
            lambda lp: surrogates.sequence(lp, *args, c.seq_clip_low, c.seq_clip_high, c.dual_clip),
        ),
    ]:
        hybrid = psi_and_grad(
            lambda lp, w=weight: surrogates.hybrid(
                lp, *args, w, c.clip_low, c.clip_high, c.seq_clip_low, c.seq_clip_high, c.dual_clip
            )
        )
        reference = psi_and_grad(make_reference)
        close(hybrid[0], reference[0], f"psi at w={weight}")
        close(hybrid[1], reference[1], f"d psi / d logp at w={weight}")


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


@st.composite
def grouped_rewards(draw: st.DrawFn) -> tuple[Tensor, int]:
    group_size = draw(st.integers(2, 5))
    prompts = draw(st.integers(1, 4))
    return outcome_rewards(draw, group_size * prompts), group_size


def zero_variance(rewards: Tensor, group_size: int) -> Tensor:
    """``[N]`` bool: the response belongs to a group whose rewards are all equal."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1).repeat_interleave(group_size)


@SETTINGS
@given(
    data=grouped_rewards(),
    scale=st.sampled_from(["group", "batch", "none"]),
    std=st.sampled_from(["bessel", "population"]),
    eps=st.sampled_from([1e-6, 1e-2]),
)
def test_group_advantages(data: tuple[Tensor, int], scale: str, std: str, eps: float) -> None:
    rewards, group_size = data
    got = advantages.group(rewards, group_size, scale=scale, std=std, eps=eps)
    expected = naive.group_advantages(rewards.tolist(), group_size, scale, std, eps)
    close(got, expected, "group advantages")
    assert torch.all(got[zero_variance(rewards, group_size)] == 0), "zero-variance group not 0"


@SETTINGS
@given(data=grouped_rewards())
def test_rloo_advantages(data: tuple[Tensor, int]) -> None:
    rewards, group_size = data
    close(
        advantages.rloo(rewards, group_size),
        naive.rloo_advantages(rewards.tolist(), group_size),
        "rloo",
    )


@st.composite
def token_reward_cases(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor]:
    """``(mask, token_rewards, values)``: sparse rewards on valid tokens, 0 elsewhere; values
    everywhere (those past a response's end must be ignored)."""
    mask = draw(masks(min_tokens=2))
    g = generator(draw)
    rewards = torch.randn(mask.shape, generator=g, dtype=F64)
    sparse = torch.rand(mask.shape, generator=g) < draw(st.sampled_from([0.2, 1.0]))
    rewards = rewards * sparse * mask
    values = torch.randn(mask.shape, generator=g, dtype=F64)
    return mask, rewards, values


def close_on_mask(got: Tensor, expected: list[list[float]], mask: Tensor, what: str) -> None:
    """Equal on valid tokens, exactly 0 on masked ones."""
    expected_t = torch.tensor(expected, dtype=F64)
    valid = mask.bool()
    close(got[valid], expected_t[valid], what)
    assert torch.all(got[~valid] == 0), f"{what}: nonzero on masked positions"


@SETTINGS
@given(
    case=token_reward_cases(),
    gamma=st.sampled_from([1.0, 0.99, 0.9]),
    lam=st.sampled_from([0.95, 1.0, 0.0]),
    whiten=st.booleans(),
)
def test_gae(case: tuple[Tensor, Tensor, Tensor], gamma: float, lam: float, whiten: bool) -> None:
    mask, rewards, values = case
    adv, returns = advantages.gae(
        rewards, values, mask, gamma=gamma, lam=lam, whiten_advantages=whiten
    )
    exp_adv, exp_returns = naive.gae_advantages(rewards, values, mask, gamma, lam, whiten)
    close_on_mask(adv, exp_adv, mask, "gae advantages")
    valid = mask.bool()
    close(returns[valid], torch.tensor(exp_returns, dtype=F64)[valid], "gae returns")


@SETTINGS
@given(case=token_reward_cases(), gamma=st.sampled_from([1.0, 0.99, 0.9]), whiten=st.booleans())
def test_reinforce_pp(case: tuple[Tensor, Tensor, Tensor], gamma: float, whiten: bool) -> None:
    mask, rewards, _ = case
    got = advantages.reinforce_pp(rewards, mask, gamma=gamma, whiten_advantages=whiten)
    expected = naive.reinforce_pp_advantages(rewards, mask, gamma, whiten)
    close_on_mask(got, expected, mask, "reinforce_pp")


@SETTINGS
@given(data=st.data(), gamma=st.sampled_from([1.0, 0.9]), whiten=st.booleans())
def test_reinforce_pp_baseline(data: st.DataObject, gamma: float, whiten: bool) -> None:
    rewards, group_size = data.draw(grouped_rewards())
    mask = data.draw(masks(min_tokens=2, n=rewards.shape[0]))
    penalty = None
    if data.draw(st.booleans()):
        g = generator(data.draw)
        penalty = 0.05 * torch.randn(mask.shape, generator=g, dtype=F64)  # garbage off-mask too
    got = advantages.reinforce_pp_baseline(
        rewards, group_size, mask, token_penalty=penalty, gamma=gamma, whiten_advantages=whiten
    )
    expected = naive.reinforce_pp_baseline_advantages(
        rewards.tolist(), group_size, mask, penalty, gamma, whiten
    )
    close_on_mask(got, expected, mask, "reinforce_pp_baseline")
