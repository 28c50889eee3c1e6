"""Choosing the next token: temperature, top-k, top-p, greedy; with its log-probability."""

from __future__ import annotations

import torch
from torch import Tensor

from postrl.rollout.base import SamplingParams


def truncate_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus.

    The nucleus is the smallest set of most probable tokens whose probability reaches
    ``top_p`` (Holtzman et al. 2020); the most probable token is always kept.
    """
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def next_tokens(
    logits: Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``(tokens [B], logprobs [B])``; log-probs of the temperature-scaled, untruncated policy."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    truncated = truncate_logits(scaled, params.top_k, params.top_p)
    tokens = torch.multinomial(torch.softmax(truncated, dim=-1), 1, generator=generator)
    return tokens.squeeze(-1), logprobs.gather(-1, tokens).squeeze(-1)
