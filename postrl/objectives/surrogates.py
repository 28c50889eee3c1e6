"""Per-token surrogate objectives ``psi[i,t]`` for each importance-ratio unit
(docs/algorithms.md §2).

The token loss is ``-psi``; ``aggregation.py`` turns it into one number. Each surrogate
returns a :class:`Surrogate` with the term, the ratio it used and where clipping was active,
so that diagnostics are computed once, in ``policy_loss.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.objectives.ratios import (
    sequence_ratio,
    sequence_token_ratio,
    token_log_ratio,
    token_ratio,
)


@dataclass
class Surrogate:
    """A per-token surrogate and where its clipping was active (all ``[N, T]``)."""

    psi: Tensor
    ratio: Tensor  # the ratio z the surrogate used, for statistics (detached)
    clipped_low: Tensor  # bool: A < 0 and the lower bound took the gradient away
    clipped_high: Tensor  # bool: A > 0 and the upper bound took the gradient away
    dual_clipped: Tensor  # bool: A < 0 and the dual-clip bound c*A was taken
    per_response: bool  # the ratio is one number per response (GSPO): count responses


def clip(z: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``clip(z, 1 - eps_low, 1 + eps_high)``; ``eps_high > eps_low`` is DAPO's clip-higher."""
    return z.clamp(1.0 - eps_low, 1.0 + eps_high)


def ppo_clipped(z: Tensor, z_clipped: Tensor, adv: Tensor, dual_clip: float | None) -> Surrogate:
    """``psi = min(z*A, z_clipped*A)``; with dual-clip ``c > 1`` and ``A < 0``: ``max(psi, c*A)``.

    PPO (Schulman et al. 2017 eq. 7); dual-clip (Ye et al. 2019 eq. 5). ``z_clipped`` is the
    clipped ratio, or for DHPO the mixture of branch-wise clipped ratios.
    """
    unclipped, clipped = z * adv, z_clipped * adv
    psi = torch.minimum(unclipped, clipped)
    clip_active = (clipped < unclipped).detach()
    dual = torch.zeros_like(clip_active)
    if dual_clip is not None:
        bound = dual_clip * adv
        dual = ((adv < 0) & (psi < bound)).detach()
        psi = torch.where(dual, bound, psi)
    return Surrogate(
        psi=psi,
        ratio=z.detach(),
        clipped_low=clip_active & (adv < 0),
        clipped_high=clip_active & (adv > 0),
        dual_clipped=dual,
        per_response=False,
    )


def token(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip=None) -> Surrogate:
    """Token-level PPO surrogate with ``z = r[i,t]`` (PPO, GRPO, DAPO)."""
    r = token_ratio(logp, old_logp, mask)
    return ppo_clipped(r, clip(r, eps_low, eps_high), adv, dual_clip)


def sequence(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip=None) -> Surrogate:
    """GSPO (Zheng et al. 2025 eq. 5): ``z = s_i`` on every token, clipped per response."""
    s = sequence_ratio(logp, old_logp, mask).unsqueeze(1).expand_as(logp)
    out = ppo_clipped(s, clip(s, eps_low, eps_high), adv, dual_clip)
    out.per_response = True
    return out


def sequence_token(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip=None) -> Surrogate:
    """GSPO-token (Zheng et al. 2025 eq. 13): value of ``s_i``, per-token gradient path."""
    z = sequence_token_ratio(logp, old_logp, mask)
    out = ppo_clipped(z, clip(z, eps_low, eps_high), adv, dual_clip)
    out.per_response = True
    return out


def hybrid(
    logp, old_logp, adv, mask, weight, tok_low, tok_high, seq_low, seq_high, dual_clip=None
) -> Surrogate:
    """DHPO (Min et al. 2026, postrl's reconstruction — see docs/algorithms.md §2).

    ``z = w*r + (1-w)*s`` and ``z_clipped = w*clip(r, tok) + (1-w)*clip(s, seq)``: each branch
    is clipped in its own trust region before mixing; ``psi = min(z*A, z_clipped*A)``.
    ``weight`` is a float or a detached ``[N, T]`` tensor in ``[0, 1]``.
    """
    r = token_ratio(logp, old_logp, mask)
    s = sequence_ratio(logp, old_logp, mask).unsqueeze(1).expand_as(logp)
    z = weight * r + (1 - weight) * s
    z_clipped = weight * clip(r, tok_low, tok_high) + (1 - weight) * clip(s, seq_low, seq_high)
    return ppo_clipped(z, z_clipped, adv, dual_clip)


def geometric(logp, old_logp, adv, mask, eps_low, eps_high) -> Surrogate:
    """GMPO (Zhao et al. 2025 eq. 4): geometric mean of clipped token ratios, per response.

    Token log-ratios are clipped in log space to ``[-eps_low, eps_high]`` (pessimistically:
    ``min`` when ``A > 0``, ``max`` when ``A < 0``); ``psi_i = A_i * exp(mean_t clipped)`` is
    placed on every valid token of response ``i``. Needs one advantage per response.
    """
    valid = mask.bool()
    first = adv.gather(1, valid.int().argmax(dim=1, keepdim=True))
    if (adv - first).masked_fill(~valid, 0.0).abs().max() > 0:
        raise ValueError("ratio='geometric' needs one advantage per response (GMPO's psi is "
                         "per response), got advantages that vary within a response")
    log_r = token_log_ratio(logp, old_logp, mask)
    clipped = log_r.clamp(-eps_low, eps_high)
    positive = adv > 0
    pessimistic = torch.where(
        positive, torch.minimum(log_r, clipped), torch.maximum(log_r, clipped)
    )
    lengths = mask.to(logp.dtype).sum(dim=1, keepdim=True).clamp(min=1)
    mean_log = (pessimistic * mask).sum(dim=1, keepdim=True) / lengths
    psi = adv * mean_log.exp()
    active = (pessimistic != log_r).detach()
    return Surrogate(
        psi=psi,
        ratio=log_r.detach().exp(),
        clipped_low=active & (adv < 0),
        clipped_high=active & positive,
        dual_clipped=torch.zeros_like(active),
        per_response=False,
    )


def cispo(logp, old_logp, adv, mask, eps_high) -> Surrogate:
    """CISPO (MiniMax-M1 2025 eq. 4): ``psi = sg(min(r, 1 + eps_high)) * A * logp``.

    The importance weight is truncated, never the gradient: every token keeps its gradient.
    ``clipped_high`` counts tokens whose weight was truncated, whatever the sign of ``A``.
    """
    r = token_ratio(logp, old_logp, mask)
    weight = r.clamp(max=1.0 + eps_high).detach()
    truncated = (r > 1.0 + eps_high).detach()
    return Surrogate(
        psi=weight * adv * logp.masked_fill(~mask.bool(), 0.0),
        ratio=r.detach(),
        clipped_low=torch.zeros_like(truncated),
        clipped_high=truncated,
        dual_clipped=torch.zeros_like(truncated),
        per_response=False,
    )


SAPO_LOG_RATIO_BOUND = 20.0  # exp(+-20) keeps the gate's input finite (as verl's SAPO does)
# the detached IS weight is truncated here; verl's clip_ratio_c defaults to 3.0 in its config,
# 20 is only its code's fallback when the key is missing
DPPO_WEIGHT_CAP = 20.0


def sapo(logp, old_logp, adv, mask, tau_pos, tau_neg) -> Surrogate:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347, eqs.
    5-6): a soft gate instead of a clip, ``psi = (4/tau) * sigmoid(tau * (r - 1)) * A`` with
    ``tau = tau_pos`` for ``A > 0`` and ``tau_neg`` otherwise. Its gradient is
    ``4 sigma (1 - sigma) * A * r * grad logp``: the policy gradient at ``r = 1``, fading
    smoothly away from it (faster for negative advantages: ``tau_neg > tau_pos``). Nothing is
    clipped, so the clip fractions are 0."""
    log_r = token_log_ratio(logp, old_logp, mask).clamp(-SAPO_LOG_RATIO_BOUND,
                                                        SAPO_LOG_RATIO_BOUND)
    r = log_r.exp()
    tau = torch.where(adv > 0, torch.full_like(r, tau_pos), torch.full_like(r, tau_neg))
    psi = (4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * adv
    none = torch.zeros_like(mask, dtype=torch.bool)
    return Surrogate(psi=psi.masked_fill(~mask.bool(), 0.0), ratio=r.detach(), clipped_low=none,
                     clipped_high=none, dual_clipped=none, per_response=False)


def binary_divergence(logp: Tensor, old_logp: Tensor, kind: str) -> Tensor:
    """DPPO's divergence between pi_old and pi on the partition {sampled token, the rest}
    (Qi et al. 2026 eqs. 13-14): total variation ``|p - q|``, or the KL
    ``q log(q/p) + (1-q) log((1-q)/(1-p))`` with ``q = pi_old``, ``p = pi`` of the token
    (the ``1e-8`` keeps ``log`` finite at a probability of 1, as verl does)."""
    p, q = logp.detach().exp(), old_logp.detach().exp()
    if kind == "tv":
        return (p - q).abs()
    return q * (old_logp.detach() - logp.detach()) + (1 - q) * torch.log(
        (1 - q + 1e-8) / (1 - p + 1e-8))


def dppo(logp, old_logp, adv, mask, delta_low, delta_high, kind) -> Surrogate:
    """DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv 2602.04879, Binary-TV and Binary-KL; verl's ``dppo_tv`` / ``dppo_kl``): a token
    whose probability moved, in the direction its advantage pushes, by a divergence beyond
    ``delta`` (``delta_high`` for ``A > 0``, ``delta_low`` for ``A < 0``) gets no gradient;
    every other token the importance-weighted policy gradient
    ``sg(min(r, 20)) * A * grad logp``. ``psi`` has the value ``M * min(r, 20) * A``."""
    valid = mask.bool()
    r = token_ratio(logp, old_logp, mask)
    divergence = binary_divergence(logp, old_logp, kind)
    rose, fell = (logp > old_logp).detach(), (logp < old_logp).detach()
    masked_high = valid & (adv > 0) & rose & (divergence > delta_high)
    masked_low = valid & (adv < 0) & fell & (divergence > delta_low)
    keep = ~(masked_high | masked_low)
    weight = r.clamp(max=DPPO_WEIGHT_CAP).detach()
    own = torch.exp(logp - logp.detach())  # 1, with the gradient of logp
    psi = (weight * own * adv).masked_fill(~(keep & valid), 0.0)
    return Surrogate(psi=psi, ratio=r.detach(), clipped_low=masked_low,
                     clipped_high=masked_high, dual_clipped=torch.zeros_like(valid),
                     per_response=False)
