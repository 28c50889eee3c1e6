"""Importance ratios between the current policy and the policy that sampled the batch
(docs/algorithms.md §2).

All inputs are response-aligned ``[N, T]`` log-probabilities of the sampled tokens.
``old_logp`` is treated as a constant (it is detached here).
"""

from __future__ import annotations

import torch
from torch import Tensor


def response_lengths(response_mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Valid tokens per response ``L_i`` as a float ``[N]`` (exact up to 2**24 in float32)."""
    return response_mask.to(dtype).sum(dim=1)


def token_log_ratio(logp: Tensor, old_logp: Tensor, response_mask: Tensor) -> Tensor:
    """``logp - old`` on valid tokens, exactly 0 elsewhere (so padding never overflows exp)."""
    return (logp - old_logp.detach()).masked_fill(~response_mask.bool(), 0.0)


def token_ratio(logp: Tensor, old_logp: Tensor, response_mask: Tensor) -> Tensor:
    """Token ratio ``r[i,t] = exp(logp - old)`` (PPO, Schulman et al. 2017 eq. 6)."""
    return token_log_ratio(logp, old_logp, response_mask).exp()


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, response_mask: Tensor) -> Tensor:
    """``log s_i = sum_t m*(logp - old) / L_i``, 0 for an empty response: ``[N]``."""
    lengths = response_lengths(response_mask, logp.dtype).clamp(min=1)
    return token_log_ratio(logp, old_logp, response_mask).sum(dim=1) / lengths


def sequence_ratio(logp: Tensor, old_logp: Tensor, response_mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence ratio ``s_i`` (Zheng et al. 2025 eq. 7): ``[N]``."""
    return sequence_log_ratio(logp, old_logp, response_mask).exp()


def sequence_token_ratio(logp: Tensor, old_logp: Tensor, response_mask: Tensor) -> Tensor:
    """GSPO-token ratio ``sg(s_i) * exp(logp - sg(logp))`` (Zheng et al. 2025 eq. 13–14).

    Its value is ``s_i`` on every valid token; its gradient flows through each token's own
    ``logp`` only. ``[N, T]``, 1 off-mask.
    """
    seq = sequence_ratio(logp, old_logp, response_mask).detach().unsqueeze(1)
    own = (logp - logp.detach()).masked_fill(~response_mask.bool(), 0.0).exp()
    return seq * own


def entropy_mixing_weight(entropy: Tensor, response_mask: Tensor) -> Tensor:
    """DHPO entropy-guided mixing weight ``w[i,t] = sg(minmax_i(H[i,t]))`` in ``[0, 1]``.

    Min–max normalised over the valid tokens of each response (postrl's reconstruction of
    Min et al. 2026, see docs/algorithms.md §2). A response whose tokens all have the same entropy
    (e.g. a single token) has no "forking" token to favour and falls back to averaged mixing,
    ``w = 1/2``. Off-mask entries are 0.
    """
    valid = response_mask.bool()
    entropy = entropy.detach()
    high = entropy.masked_fill(~valid, float("-inf")).amax(dim=1, keepdim=True)
    low = entropy.masked_fill(~valid, float("inf")).amin(dim=1, keepdim=True)
    spread = high - low
    flat = ~(spread > 0)
    weight = (entropy - low) / torch.where(flat, torch.ones_like(spread), spread)
    weight = torch.where(flat, torch.full_like(weight, 0.5), weight)
    return weight.masked_fill(~valid, 0.0)
