"""Loss aggregation over the GLOBAL batch (docs/algorithms.md §3).

One optimizer step may span micro-batches and data-parallel ranks. Each micro-batch's loss is
normalised by the counts of the whole step (``BatchCounts`` summed over micro-batches and
ranks), so that summing the micro-batch gradients gives exactly the full-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
AGGREGATIONS: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


@dataclass(frozen=True)
class BatchCounts:
    """Valid tokens ``T`` and responses with at least one valid token ``N``."""

    tokens: int
    responses: int

    @classmethod
    def of(cls, response_mask: Tensor) -> BatchCounts:
        valid = response_mask.bool()
        return cls(tokens=int(valid.sum()), responses=int(valid.any(dim=1).sum()))

    def __add__(self, other: BatchCounts) -> BatchCounts:
        return BatchCounts(self.tokens + other.tokens, self.responses + other.responses)


def aggregate(
    values: Tensor,
    response_mask: Tensor,
    mode: Aggregation,
    counts: BatchCounts,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce per-token ``values [N, T]`` to this micro-batch's share of the global scalar.

    - ``token_mean`` (DAPO §3.3): ``sum m*l / T``
    - ``seq_mean_token_mean`` (GRPO paper eq. 3, GSPO): ``1/N sum_i (sum_t m*l / L_i)``
    - ``seq_mean_token_sum``: ``1/N sum_i sum_t m*l``
    - ``seq_mean_token_sum_norm`` (Dr. GRPO, Liu et al. 2025 §3.1): ``sum m*l / (N*C)`` with a
      constant ``C`` (``norm_constant``, by default max_new_tokens). verl's variant omits the
      ``1/N``: the same direction, scaled by the constant N.
    """
    mask = response_mask.to(values.dtype)
    masked = values * mask
    if mode == "token_mean":
        return masked.sum() / max(counts.tokens, 1)
    if mode == "seq_mean_token_mean":
        lengths = mask.sum(dim=1).clamp(min=1)
        return (masked.sum(dim=1) / lengths).sum() / max(counts.responses, 1)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(counts.responses, 1)
    if mode == "seq_mean_token_sum_norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError("seq_mean_token_sum_norm needs a positive norm_constant")
        return masked.sum() / (max(counts.responses, 1) * norm_constant)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
