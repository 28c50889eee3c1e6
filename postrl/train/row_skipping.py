"""Rows of a minibatch that contribute no gradient, and what the update does with them.

Under a loss whose only per-token terms are the surrogate's, a row none of whose tokens has
a non-zero advantage (a group whose rewards are all equal) adds exactly zero to the gradient,
though its tokens still count in the normalisers. Such rows run forward only, for their
diagnostics, or not at all when the sampler's own entropies stand in for that forward. A
speed-up, not part of the algorithm: with ``forward_only_zero_gradient`` off every row trains,
to the same step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from postrl.objectives import (
    BatchCounts,
    Diagnostics,
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
)
from postrl.recipes import Recipe
from postrl.train.batch import TrainBatch


def advantage_terms_only(loss_cfg: PolicyLossConfig, critic: bool) -> bool:
    """Whether the update's only per-token terms are the surrogate's: no KL in the loss, no
    entropy bonus, and no critic to train. Every surrogate is ``ratio * advantage`` in some
    form (docs/algorithms.md §2), so a row without a non-zero advantage then has no gradient."""
    return not (critic or loss_cfg.kl_coef or loss_cfg.entropy_coef)


def zero_gradient_rows(rows: Tensor, batch: TrainBatch, loss_cfg: PolicyLossConfig,
                       critic: bool) -> Tensor:
    """Which of ``rows`` contribute exactly nothing to the policy gradient: no response token
    with a non-zero advantage, under a loss with no other per-token term
    (:func:`advantage_terms_only`): such a row's loss is 0 and its gradient too, whatever its
    ratio; its tokens still count in the normalisers. They are the groups whose rewards
    are all equal (group-relative advantages, Dr. GRPO, RLOO) and rows with no token left
    (overlong filtering). ``critic``: whether a critic is trained. Boolean, one entry per row
    of ``rows``."""
    none = torch.zeros(len(rows), dtype=torch.bool)
    if not advantage_terms_only(loss_cfg, critic) or batch.advantages is None:
        return none
    carries = (batch.advantages[rows] != 0) & batch.response_mask[rows]
    return ~carries.any(dim=1)


def split_rows(rows: Tensor, batch: TrainBatch, loss_cfg: PolicyLossConfig, critic: bool,
               rank: int = 0, size: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """``(trained, scored, unscored)``: the rows that run forward and backward, those that
    run forward only, for the diagnostics (:func:`zero_gradient_rows`), and those that run
    not at all, their diagnostics known without a forward (:func:`unscored_diagnostics`).
    Rows without a response token add nothing to any diagnostic and are in none of the
    three. When no row has a gradient one still runs backward: its zero gradient is what the
    optimizer would have seen (momentum and weight decay still step).

    Data-parallel replicas each hold the whole batch and split the trained rows between them
    (:func:`replica_micro_batches`), and leave out rows that run not at all, whose
    diagnostics replica 0 adds. Forward-only rows would need a split of their own; there
    every row trains. ``rank`` of ``size``: this replica; ``critic``: whether one is trained."""
    none = rows[:0]
    stands_in = sampler_stands_in(batch)
    if not (size == 1 or stands_in):
        return rows, none, none
    zero = zero_gradient_rows(rows, batch, loss_cfg, critic)
    if zero.all():
        zero[int(batch.lengths[rows].argmin())] = False  # the cheapest backward
    idle = rows[zero]
    idle = idle[batch.response_mask[idle].any(dim=1)]
    if stands_in:
        return rows[~zero], none, idle if rank == 0 else none
    return rows[~zero], idle, none


def sampler_stands_in(batch: TrainBatch) -> bool:
    """Whether a row's forward would tell nothing the sampler has not: each batch is used
    for one update (no old log-probs: every ratio is exactly 1), with no reference
    (``kl/mean``), and the sampler reported its per-token entropies."""
    return batch.old_logp is None and batch.ref_logp is None and batch.sampler_entropy is not None


def unscored_rows_possible(recipe: Recipe, loss_cfg: PolicyLossConfig,
                           updates_per_batch: int) -> bool:
    """Whether a run's updates can leave rows out entirely (:func:`sampler_stands_in`), as
    far as its configuration tells: one update per batch, no reference, no critic, no KL or
    entropy term in the loss (:func:`advantage_terms_only`), groups without variance
    reach the update (no dynamic sampling), and the sampler ran the weights that train
    (no ``max_staleness``, ``old_policy=proximal``); on one process or several. The trainer asks the
    sampler for its entropies only then (what recording them costs the generation:
    bench/log.md, "Rows without a gradient run no forward")."""
    return (advantage_terms_only(loss_cfg, recipe.critic) and updates_per_batch == 1
            and not recipe.needs_reference and not recipe.dynamic_sampling
            and not recipe.max_staleness and recipe.old_policy == "proximal")


def unscored_diagnostics(batch: TrainBatch, rows: Tensor, loss_cfg: PolicyLossConfig,
                         counts: BatchCounts) -> Diagnostics:
    """The diagnostics a forward of ``rows`` (no gradient, :func:`sampler_stands_in`) would have
    added: ratios exactly 1 (the old log-probs would be the forward's own, detached), loss
    terms 0 (every advantage is), and the sampler's entropies, which are the same policy's
    at the same temperature. :func:`policy_loss` itself computes them, from log-probs of 0."""
    width = max(int(batch.lengths[rows].max()), 1)
    mask = batch.response_mask[rows, :width]
    zeros = torch.zeros(mask.shape)
    inputs = PolicyLossInputs(zeros, zeros, batch.advantages[rows, :width], mask,
                              entropy=batch.sampler_entropy[rows, :width])
    # no trainer forward: no mismatch to measure, and the weights of zero terms change nothing
    uncorrected = dataclasses.replace(loss_cfg, mismatch_weight="none", mismatch_reject=None)
    return policy_loss(inputs, uncorrected, counts).diagnostics
