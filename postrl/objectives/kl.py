"""KL to the reference policy, estimated on sampled tokens (docs/algorithms.md §4).

Schulman's estimators ("Approximating KL divergence", 2020) of KL(pi_theta || pi_ref) with
``log_ratio = ref - logp``: k1 is unbiased, k2 and k3 are low-variance. GRPO uses k3
(Shao et al. 2024 eq. 4).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["k1", "k2", "k3"]

K3_CLAMP = 10.0  # k3 is clamped to [-10, 10], as verl's low-variance KL does
LOG_RATIO_CLAMP = 20.0  # keeps exp() finite; beyond it the gradient is 0, like the k3 clamp


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: Estimator) -> Tensor:
    """Per-token KL estimate ``[N, T]``; ``ref_logp`` is a constant."""
    log_ratio = ref_logp.detach() - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # expm1(x) - x, not exp(x) - x - 1: the same value, without float32 cancellation
        # to 0 for the tiny log-ratios of a policy close to its reference
        return (torch.expm1(log_ratio) - log_ratio).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dimension: ``logsumexp(z) - sum softmax(z)*z``."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
