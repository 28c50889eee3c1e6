"""Advantage estimators (docs/algorithms.md §1).

Conventions: outcome rewards are a float tensor ``[N]`` whose responses come in contiguous
groups of ``group_size`` (all samples of one prompt are adjacent). Token-level tensors are
response-aligned ``[N, T]`` with a ``response_mask`` (1 = a generated token that is trained on).
Every function returns advantages that are exactly 0 on masked positions.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Scale = Literal["group", "batch", "none"]
StdMode = Literal["bessel", "population"]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View ``[N]`` rewards as ``[P, G]``; N must be a multiple of G."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.view(-1, group_size)


def _std(x: Tensor, dim: int | None, std: StdMode) -> Tensor:
    correction = 1 if std == "bessel" else 0
    if dim is None:
        return x.std(correction=correction)
    return x.std(dim=dim, keepdim=True, correction=correction)


def group(
    rewards: Tensor,
    group_size: int,
    scale: Scale = "group",
    std: StdMode = "bessel",
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantage, one value per response.

    ``A_i = (R_i - mean_g(R)) / (std + eps)`` (GRPO, Shao et al. 2024 §4.1.2), where the std is
    the group's (``scale="group"``), the whole batch's (``"batch"``) or omitted (``"none"``,
    Dr. GRPO, Liu et al. 2025 §3.1). ``std="bessel"`` divides by G-1 like TRL and verl,
    ``"population"`` by G. A group whose rewards are all equal gets exactly 0 for every member,
    whatever rounding the mean would leave behind.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        if group_size < 2 and std == "bessel":
            raise ValueError("scale='group' with Bessel's std needs group_size >= 2")
        centred = centred / (_std(grouped, 1, std) + eps)
    elif scale == "batch":
        centred = centred / (_std(rewards, None, std) + eps)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}; expected group, batch or none")
    zero_variance = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return centred.masked_fill(zero_variance, 0.0).reshape(-1)


def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out baseline: ``A_i = R_i - mean_{j != i} R_j`` (Ahmadian et al. 2024 eq. 7)."""
    if group_size < 2:
        raise ValueError("rloo needs group_size >= 2 (a leave-one-out mean of nothing)")
    grouped = _grouped(rewards, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    zero_variance = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return (grouped - others_mean).masked_fill(zero_variance, 0.0).reshape(-1)


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of each response's last valid token ``[N]`` (0 for a fully masked response)."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return (response_mask.bool() * (positions + 1)).amax(dim=1).clamp(min=1) - 1


def outcome_token_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Place each response's outcome reward on its last valid token, 0 elsewhere: ``[N, T]``."""
    token_rewards = torch.zeros_like(response_mask, dtype=rewards.dtype)
    has_tokens = response_mask.bool().any(dim=1)
    token_rewards[torch.arange(rewards.numel()), last_token_index(response_mask)] = rewards
    return token_rewards * has_tokens.unsqueeze(1)


def whiten(values: Tensor, response_mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the batch's valid tokens (Bessel var); 0 off-mask."""
    valid = response_mask.bool()
    selected = values[valid]
    if selected.numel() < 2:
        return torch.zeros_like(values)
    mean, var = selected.mean(), selected.var(correction=1)
    return ((values - mean) * torch.rsqrt(var + eps)).masked_fill(~valid, 0.0)


def gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015 eq. 16; PPO 2017 eq. 11).

    ``delta_t = rho_t + gamma * V_{t+1} - V_t`` and ``A_t = sum_l (gamma*lam)^l delta_{t+l}``,
    walking only over valid tokens, with ``V = 0`` past a response's last valid token.
    Returns ``(advantages, returns)`` with ``returns = A + V`` computed before whitening;
    the advantages are then whitened over the valid tokens of the batch.
    """
    valid = response_mask.bool()
    values = values.detach()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        step_valid = valid[:, t]
        advantages[:, t] = torch.where(step_valid, candidate, 0.0)
        running = torch.where(step_valid, candidate, running)
        next_value = torch.where(step_valid, values[:, t], next_value)
    returns = (advantages + values).masked_fill(~valid, 0.0)
    if whiten_advantages:
        advantages = whiten(advantages, response_mask)
    return advantages, returns


def _return_to_go(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    valid = response_mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        candidate = token_rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid[:, t], candidate, 0.0)
        running = torch.where(valid[:, t], candidate, running)
    return returns


def reinforce_pp(
    token_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    whiten_advantages: bool = True,
) -> Tensor:
    """REINFORCE++ (Hu 2025 §3): return-to-go of the token rewards, whitened over the batch."""
    returns = _return_to_go(token_rewards, response_mask, gamma)
    return whiten(returns, response_mask) if whiten_advantages else returns


def reinforce_pp_baseline(
    rewards: Tensor,
    group_size: int,
    response_mask: Tensor,
    token_penalty: Tensor | None = None,
    gamma: float = 1.0,
    whiten_advantages: bool = True,
) -> Tensor:
    """REINFORCE++-baseline (Hu 2025 §3.3): subtract the group mean reward, then REINFORCE++.

    ``token_penalty`` (e.g. ``beta * k`` per token, KL placed in the reward) is subtracted
    from the token rewards before the return-to-go.
    """
    grouped = _grouped(rewards, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    token_rewards = outcome_token_rewards(centred, response_mask)
    if token_penalty is not None:
        token_rewards = token_rewards - token_penalty * response_mask
    return reinforce_pp(token_rewards, response_mask, gamma, whiten_advantages)
