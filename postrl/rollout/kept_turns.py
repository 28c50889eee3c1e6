"""What a sampler keeps of one call's rows for the next: the keys and values of every row that
ended its turn, so that the episode's next turn prefills only what is new.

A multi-turn episode's next prompt is its previous prompt, the turn as sampled and the
environment's reply (``postrl.rollout.episodes``). The earlier tokens are unchanged, and so are
their keys and values, up to the rounding of a batch of another shape: re-reading them at every
turn is what made prefill most of a tool episode's generation time. Kept here, the next turn
feeds only the turn's last sampled token (never fed while sampling), the reply and the next
header. vLLM does the same by its own prefix caching (``postrl.rollout.vllm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.models.backend import Past


@dataclass(frozen=True)
class KeptRow:
    """``tokens`` and their keys and values, ``[layers, kv_heads, len(tokens), head_dim]``."""

    tokens: tuple[int, ...]
    keys: Tensor
    values: Tensor


class TurnCache:
    """The rows one call kept, for the next call only: a call takes them and keeps its own."""

    def __init__(self) -> None:
        self.rows: list[KeptRow] = []

    def keep(self, row: KeptRow) -> None:
        self.rows.append(row)

    def take(self, prompts: list[list[int]]) -> list[KeptRow | None]:
        """For each prompt, the longest kept row whose tokens begin it and leave at least one
        token to feed (None: none does); the cache is then empty."""
        matched = [_longest_prefix(self.rows, prompt) for prompt in prompts]
        self.rows = []
        return matched


def _longest_prefix(rows: list[KeptRow], prompt: list[int]) -> KeptRow | None:
    best = None
    for row in rows:
        n = len(row.tokens)
        if n < len(prompt) and (best is None or n > len(best.tokens)) \
                and tuple(prompt[:n]) == row.tokens:
            best = row
    return best


def prefill_inputs(prompts: list[list[int]], matched: list[KeptRow | None], pad_id: int
                   ) -> tuple[Past | None, Tensor, Tensor, Tensor]:
    """``(past, input_ids, attention, positions)`` of a prefill that starts from ``matched``.

    ``input_ids [rows, M]`` holds each prompt's last ``M`` tokens, ``M`` the most any prompt
    has beyond its kept row (so a row may recompute a few kept tokens, never skip one);
    ``attention`` and ``positions`` ``[rows, Q + M]`` cover the past's ``Q`` columns and
    those, each row's tokens right-aligned, as left padding does. Without a kept row:
    ``past`` None and the whole prompts, left-padded."""
    new = [len(p) - (len(k.tokens) if k is not None else 0) for p, k in zip(prompts, matched,
                                                                            strict=True)]
    width = max(new)
    fed = [min(width, len(p)) for p in prompts]
    kept = [len(p) - f for p, f in zip(prompts, fed, strict=True)]
    depth = max(kept)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), depth + width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - fed[i]:] = torch.tensor(prompt[len(prompt) - fed[i]:])
        attention[i, depth - kept[i]:depth] = 1
        attention[i, depth + width - fed[i]:] = 1
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    if depth == 0:
        return None, input_ids, attention, positions
    like = next(k for k in matched if k is not None).keys
    layers, kv_heads, _, dim = like.shape
    shape = (layers, len(prompts), kv_heads, depth, dim)
    # zeros, not garbage: a masked column's weight is exactly 0, and 0 * NaN is NaN
    keys, values = like.new_zeros(shape), like.new_zeros(shape)
    for i, (row, n) in enumerate(zip(matched, kept, strict=True)):
        if n:
            keys[:, i, :, depth - n:] = row.keys[:, :, :n]
            values[:, i, :, depth - n:] = row.values[:, :, :n]
    return Past(keys, values), input_ids, attention, positions
