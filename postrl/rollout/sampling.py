"""Choosing the next token: temperature, top-k, top-p, greedy; with its log-probability and
the policy's entropy at that position (both before truncation).

Sampling is keyed per response: response ``j`` of prompt ``i`` draws its randomness from its
own generator, seeded by ``(seed, i, j)`` alone (:func:`row_seed`). Which other prompts share
the batch, how rows are chunked, or which rollout worker runs them never changes the random
numbers a response sees. A token is drawn by inversion: one uniform ``u`` per row and step,
and the first token whose cumulative probability (summed in float64) exceeds ``u``. A backend
may draw untruncated tokens itself (``postrl.models.backend``: ``Backend.draw``) by the same
rule: the same tokens but where ``u`` falls within float rounding of a boundary.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from postrl.models import backend
from postrl.rollout.base import SamplingParams


def top_k_truncates(top_k: int, vocab: int) -> bool:
    """Whether top-k drops any of ``vocab`` tokens (0, or ``vocab`` and more, keep them all)."""
    return bool(top_k) and top_k < vocab


def truncate_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus.

    The nucleus is the smallest set of most probable tokens whose probability reaches
    ``top_p`` (Holtzman et al. 2020); the most probable token is always kept.
    """
    if top_k_truncates(top_k, scaled.shape[-1]):
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


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one response, a stable function of its key (not of the process)."""
    key = f"{seed}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def row_generators(seed: int, first_prompt: int, prompts: int, group_size: int
                   ) -> list[torch.Generator]:
    """One generator per response, prompt-major like the rows of a :class:`Rollouts`."""
    return [torch.Generator().manual_seed(row_seed(seed, first_prompt + i, j))
            for i in range(prompts) for j in range(group_size)]


def uniforms(generators: list[torch.Generator]) -> Tensor:
    """``[len(generators), 1]`` float64 U(0, 1) draws, row ``r`` from generator ``r``."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])[:, None]


def next_tokens(logits: Tensor, params: SamplingParams, generators: list[torch.Generator] | None,
                with_entropy: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(tokens [B], logprobs [B], entropies [B] or None)`` of the temperature-scaled,
    untruncated policy (greedy: of the unscaled logits), as the trainer's forward computes
    them; the entropies only ``with_entropy`` (a pass over the vocabulary).

    ``generators`` holds one generator per row (unused when greedy).
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return (tokens, *_logprob_and_entropy(logits, tokens, None, with_entropy))
    truncating = top_k_truncates(params.top_k, logits.shape[-1]) or params.top_p < 1.0
    if not truncating and backend.active().draws(logits):
        return backend.active().draw(logits, params.temperature,
                                     uniforms(generators).flatten(), with_entropy)
    scaled = logits / params.temperature
    truncated = truncate_logits(scaled, params.top_k, params.top_p)
    probs = torch.softmax(truncated, dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    # the first token whose cumulative mass exceeds u * total: token i with probability p_i
    draws = uniforms(generators).to(cdf.device)  # CPU generators: same draws on any device
    tokens = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True)
    tokens = tokens.squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    untruncated = probs if truncated is scaled else None
    return (tokens, *_logprob_and_entropy(scaled, tokens, untruncated, with_entropy))


def _logprob_and_entropy(logits: Tensor, tokens: Tensor, probs: Tensor | None,
                         with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``log p(token)`` and ``H = logsumexp(z) - sum p z`` (the training forward's formula,
    ``postrl.models.vocab``); ``probs``, when given, is ``softmax(logits)`` already.

    With ``probs`` the log-sum-exp comes from the softmax itself: at the largest logit
    ``p = 1 / sum exp(z - max)``, rounded once, so ``lse = max - log p`` there (a separate
    ``logsumexp`` would be another pass over the vocabulary). ``sum p z`` is divided by
    ``sum p``: on the CPU ``torch.softmax``'s float32 probabilities sum to 1 only within
    ~5e-6, which logits of magnitude ~20 would turn into an entropy error of ~1e-4."""
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1)
    if probs is None and not with_entropy:
        return picked - torch.logsumexp(logits, dim=-1), None
    probs = torch.softmax(logits, dim=-1) if probs is None else probs
    top, where = logits.max(dim=-1, keepdim=True)
    lse = (top - probs.gather(-1, where).log()).squeeze(-1)
    if not with_entropy:
        return picked - lse, None
    return picked - lse, lse - torch.linalg.vecdot(probs, logits) / probs.sum(dim=-1)
