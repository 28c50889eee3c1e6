"""Data-parallel replicas of the update: each replica's share of an optimizer step's rows,
and the merge of every replica's results into what one process would have seen
(``postrl.train.distributed`` subclasses :class:`Replica`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.objectives import Diagnostics


class Replica:
    """This process's share of every optimizer step: data-parallel rank ``rank`` of ``size``.
    A single process is rank 0 of 1; ``postrl.train.distributed`` overrides the two hooks."""

    rank: int = 0
    size: int = 1
    # whether every replica must run as many forwards as the others (FSDP2's gather the
    # weights together: :func:`replica_micro_batches` pads); DDP's need not
    # (``postrl.train.distributed.parallel.replicate``)
    forwards_must_match: bool = False

    def accumulating(self, last: bool) -> AbstractContextManager:
        """Around each micro-batch: gradients synchronise only on the last one."""
        return nullcontext()

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Each flag, and-ed over the replicas (so that all of them skip a step, or none)."""
        return flags


@dataclass
class RoundResult:
    """One optimizer step as one replica saw it: its shares of the diagnostics and of the
    value loss, and what every replica agrees on (gradient norm, skipped updates)."""

    diagnostics: Diagnostics
    value_loss: float | Tensor | None = None  # None without a critic
    value_clip: float | Tensor | None = None
    grad_norm: float | None = None  # None when the policy is not trained (critic warm-up)
    skipped: bool = False


def replica_micro_batches(rows: Tensor, rank: int, size: int,
                          split: int | Callable[[Tensor], list[Tensor]],
                          order=None, equal_counts: bool = False) -> list[tuple[Tensor, float]]:
    """``(rows, weight)`` of the micro-batches replica ``rank`` of ``size`` runs for one
    minibatch: its contiguous share, reordered by ``order`` (e.g. :func:`length_sorted`), cut
    by ``split`` (rows per micro-batch, or a function of the ordered share:
    ``postrl.train.micro_batches``). A replica whose share is empty runs one row with weight 0
    (no gradient, no diagnostics), so that every replica takes part in the gradient
    all-reduce. Shares differ by up to a row, and so may their numbers of micro-batches;
    ``equal_counts`` (FSDP2, whose every forward is a collective:
    :attr:`Replica.forwards_must_match`) pads each replica's up to the most with such
    weight-0 rows."""

    def cut(share: Tensor) -> list[Tensor]:
        share = order(share) if order is not None else share
        return list(torch.split(share, split)) if isinstance(split, int) else split(share)

    shares = torch.tensor_split(rows, size)
    micros = ([(micro, 1.0) for micro in cut(shares[rank])] if len(shares[rank])
              else [(rows[:1], 0.0)])
    if equal_counts:
        most = max(len(cut(share)) if len(share) else 1 for share in shares)
        micros += [(rows[:1], 0.0)] * (most - len(micros))
    return micros


def merge_replicas(per_replica: list[list[RoundResult]]) -> list[RoundResult]:
    """The results of every replica, round by round, as one process would have seen them."""
    merged = []
    for results in zip(*per_replica, strict=True):
        diagnostics = Diagnostics()
        for result in results:
            diagnostics = diagnostics.merge(result.diagnostics)
        first = results[0]
        merged.append(RoundResult(
            diagnostics,
            None if first.value_loss is None else sum(r.value_loss for r in results),
            None if first.value_clip is None else sum(r.value_clip for r in results),
            first.grad_norm, any(r.skipped for r in results)))
    return merged
