"""On-policy distillation: the reverse KL to a teacher, per sampled token, as an advantage
(docs/algorithms.md §11).

The student samples; a frozen teacher scores the student's own tokens. With
``d[i,t] = log pi_student(y_t) - log pi_teacher(y_t)`` on a token the student drew, ``d`` is
the one-sample (k1) estimate of the per-token reverse KL, KL(pi_student || pi_teacher), at
that position. Its negative is a dense, per-token reward with discount 0: it enters each
token's advantage directly, weighted by ``coef``, beside whatever the verifier's rewards give
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD) with on-policy data and the reverse KL; Thinking Machines Lab, "On-Policy
Distillation", 2025, which puts it in the advantage exactly so). With discount 0 each
token's policy gradient follows minus the gradient of the reverse KL at its own position
(the score-function identity), ignoring what the token does to later positions' KL; the
reverse KL is mode-seeking: the student moves its mass onto tokens the teacher finds likely.
"""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.objectives.kl import LOG_RATIO_CLAMP


def reverse_kl_tokens(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """``d = log pi_student - log pi_teacher`` per token ``[N, T]``, 0 off ``mask``: the k1
    estimate of the reverse KL on the student's own samples. Both are constants here."""
    d = (student_logp.detach() - teacher_logp.detach()).clamp(-LOG_RATIO_CLAMP,
                                                               LOG_RATIO_CLAMP)
    return torch.where(mask.bool(), d, 0.0)


def distill_advantages(reverse_kl: Tensor, coef: float) -> Tensor:
    """The distillation term of each token's advantage, ``-coef * d`` (discount 0)."""
    return -coef * reverse_kl


def distill_metrics(reverse_kl: Tensor, teacher_logp: Tensor,
                    mask: Tensor) -> dict[str, float]:
    """``distill/*`` over the tokens of ``mask``: the reverse KL per token, its k1 estimate
    and the never-negative k3 of Schulman 2020 (``r - 1 - log r`` with ``r = pi_teacher /
    pi_student``), and the teacher's perplexity of the student's tokens. Empty when the mask
    holds no token."""
    valid = mask.bool()
    if not valid.any():
        return {}
    d = reverse_kl[valid].double()
    return {
        "distill/reverse_kl": float(d.mean()),
        "distill/reverse_kl_k3": float((torch.expm1(-d) + d).mean()),
        "distill/teacher_ppl": float(torch.exp(-teacher_logp[valid].double().mean())),
    }
