"""The sampler is not the trainer: importance weights between them, and their diagnostics
(docs/algorithms.md §9).

A rollout is sampled by one numerical policy, pi_sampler (a bf16 sampler, vLLM, a stale actor)
and scored by another, pi_old (the trainer's forward of the same weights). The clipped
surrogate's ratio pi_theta / pi_old corrects for the updates since, not for that gap. The
gap is corrected by a detached weight on each token's surrogate term,
``l[i,t] = -w[i,t] * psi(z, A)``, with ``w = pi_old / pi_sampler`` (Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training"; Liu, Li et al. 2025,
"When Speed Kills Stability"). The parts, each a recipe option:

- the unit of ``w``: per ``token``; per response as the ``sequence_product``
  ``exp(sum_t log w)`` (verl's ``rollout_is=sequence``; it under- or overflows on long
  responses, so its log is bounded to [-20, 20] and hitting the bound is counted), or the
  ``sequence_geometric`` mean ``exp(mean_t log w)``;
- what is done with large weights: ``truncate`` at C, ``min(w, C)`` (TIS), or ``mask``:
  weight 0 outside ``[low, high]`` (MIS; IcePop, Ling Team 2025, two-sided);
- sequence rejection: weight 0 for every token of a response whose geometric-mean weight
  lies outside ``[1/b, b]`` (geometric rejection; verl's ``rollout_rs=seq_mean_k1``).

Masked and rejected tokens keep their place in the normalisers (their weight is 0): the step's
gradient shrinks by their share rather than being renormalised over the rest, which keeps the
global-batch counts fixed before the update. verl does the same for its IcePop mask; only its
rejection sampling (``rollout_rs``) takes tokens out of the normalisers, and only under
token-mean and, for token-level rejection, seq-mean-token-mean.
All inputs are response-aligned ``[N, T]`` log-probs of the sampled tokens; nothing here has
a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

WEIGHT_UNITS = ("none", "token", "sequence_product", "sequence_geometric")
WEIGHT_MODES = ("truncate", "mask")
LOG_WEIGHT_BOUND = 20.0  # exp(+-20): a product weight beyond it has under- or overflowed


@dataclass(frozen=True)
class Correction:
    """What the correction does to each token: its weight (0 where masked or rejected) and
    why. ``[N, T]`` except ``rejected`` and ``bounded`` ``[N]``; all zero off the mask."""

    weight: Tensor
    raw: Tensor  # pi_old / pi_sampler in the chosen unit, before truncation or masking
    truncated: Tensor  # bool: the weight was capped at C
    masked: Tensor  # bool: the weight was outside [low, high]
    rejected: Tensor  # bool [N]: the whole response was rejected
    bounded: Tensor  # bool [N]: a product weight's log hit +-LOG_WEIGHT_BOUND


def log_weights(old_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor,
                unit: str) -> tuple[Tensor, Tensor]:
    """``(log w [N, T], bounded [N])``: ``old - sampler`` per token, or per response (its sum
    or mean over the valid tokens, on every token of the response); 0 off the mask."""
    valid = response_mask.bool()
    per_token = (old_logp.detach() - sampler_logp.detach()).double().masked_fill(~valid, 0.0)
    no_bound = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
    if unit == "token":
        return per_token, no_bound
    total = per_token.sum(dim=1)
    if unit == "sequence_product":
        bounded = total.abs() >= LOG_WEIGHT_BOUND
        per_response = total.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    elif unit == "sequence_geometric":
        bounded = no_bound
        per_response = total / valid.sum(dim=1).clamp(min=1)
    else:
        raise ValueError(f"unknown weight unit {unit!r}; expected one of {WEIGHT_UNITS[1:]}")
    return per_response.unsqueeze(1).expand_as(per_token).masked_fill(~valid, 0.0), bounded


def geometric_rejection(old_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor,
                        bound: float) -> Tensor:
    """``[N]`` bool: responses whose geometric-mean weight lies outside ``[1/b, b]``."""
    valid = response_mask.bool()
    gap = (old_logp.detach() - sampler_logp.detach()).double().masked_fill(~valid, 0.0)
    mean = gap.sum(dim=1) / valid.sum(dim=1).clamp(min=1)
    return valid.any(dim=1) & (mean.abs() > torch.log(torch.tensor(bound, dtype=torch.float64)))


def correct(old_logp: Tensor, sampler_logp: Tensor, response_mask: Tensor, unit: str,
            mode: str, cap: float, low: float, high: float,
            reject: float | None) -> Correction:
    """The weights of one micro-batch (see the module docstring); with ``unit="none"`` every
    weight is 1, and only ``reject`` may zero some."""
    valid = response_mask.bool()
    if unit == "none":
        raw = valid.double()
        bounded = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
    else:
        log_w, bounded = log_weights(old_logp, sampler_logp, response_mask, unit)
        raw = log_w.exp().masked_fill(~valid, 0.0)
    weight = raw
    truncated = masked = torch.zeros_like(valid)
    if unit != "none" and mode == "truncate":
        truncated = valid & (raw > cap)
        weight = raw.clamp(max=cap)
    elif unit != "none" and mode == "mask":
        masked = valid & ((raw < low) | (raw > high))
        weight = raw.masked_fill(masked, 0.0)
    elif unit != "none":
        raise ValueError(f"unknown weight mode {mode!r}; expected one of {WEIGHT_MODES}")
    rejected = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
    if reject is not None:
        rejected = geometric_rejection(old_logp, sampler_logp, response_mask, reject)
        weight = weight.masked_fill(rejected.unsqueeze(1), 0.0)
    return Correction(weight.masked_fill(~valid, 0.0), raw, truncated, masked, rejected,
                      bounded)


def mismatch_kl(trainer_logp: Tensor, sampler_logp: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token estimates ``(k1, k3)`` of KL(pi_sampler || pi_trainer) on the sampler's own
    tokens (Schulman 2020): ``k1 = sampler - trainer``, ``k3 = exp(d) - d - 1`` with
    ``d = trainer - sampler``. k3 is never negative; both are 0 when the two agree."""
    gap = (trainer_logp.detach() - sampler_logp.detach()).double()
    return -gap, torch.expm1(gap) - gap
