"""Policy (and critic) updates on one batch: epochs x minibatches optimizer steps, each over
micro-batches whose losses are normalised by the minibatch's GLOBAL counts (§3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.models.logprobs import response_logprobs
from postrl.models.precision import autocast
from postrl.objectives import (
    BatchCounts,
    Diagnostics,
    PolicyLossConfig,
    PolicyLossInputs,
    aggregate,
    clipped_value_loss,
    policy_loss,
)
from postrl.recipes import Recipe
from postrl.train.batch import TrainBatch


@dataclass
class UpdateSettings:
    epochs: int
    minibatches: int
    micro_batch_size: int
    temperature: float
    max_grad_norm: float | None
    pad_id: int
    train_policy: bool = True  # False during critic warm-up
    precision: str = "fp32"


def minibatch_rows(rows: int, minibatches: int, generator: torch.Generator) -> list[Tensor]:
    """Split row indices into ``minibatches`` near-equal parts; shuffled when more than one."""
    order = torch.randperm(rows, generator=generator) if minibatches > 1 else torch.arange(rows)
    return [part for part in torch.tensor_split(order, minibatches) if len(part)]


def length_sorted(rows: Tensor, batch: TrainBatch) -> Tensor:
    """``rows`` longest first, so each micro-batch pads only to its own longest sequence.
    The minibatch's loss is normalised by global counts, so the split changes no gradient."""
    lengths = [len(batch.prompt_ids[i]) + int(batch.lengths[i]) for i in rows.tolist()]
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    return rows[torch.tensor(order, dtype=torch.long)]


def average_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of several optimizer steps: mean of each value, min/max for ratio extremes."""
    merged: dict[str, float] = {}
    for key in {k for r in rounds for k in r}:
        values = [r[key] for r in rounds if key in r]
        reduce = (min if key.endswith("/min") else
                  max if key.endswith("/max") or key.startswith("guard/") else None)
        merged[key] = reduce(values) if reduce else sum(values) / len(values)
    return merged


def run_updates(policy_lm, optimizer, batch: TrainBatch, recipe: Recipe, loss_cfg: PolicyLossConfig,
                settings: UpdateSettings, generator: torch.Generator,
                critic=None, critic_optimizer=None) -> dict[str, float]:
    """All update rounds on ``batch``; returns metrics averaged over the rounds."""
    need_entropy_grad = loss_cfg.entropy_coef > 0 or (
        loss_cfg.ratio == "hybrid" and loss_cfg.hybrid_mixing == "entropy")
    params = [p for p in policy_lm.parameters() if p.requires_grad]
    rounds: list[dict[str, float]] = []
    for _ in range(settings.epochs):
        for rows in minibatch_rows(batch.rows, settings.minibatches, generator):
            counts = BatchCounts.of(batch.response_mask[rows])
            diagnostics = Diagnostics()
            value_terms: list[tuple[float, float]] = []
            optimizer.zero_grad(set_to_none=True)
            if critic_optimizer is not None:
                critic_optimizer.zero_grad(set_to_none=True)
            finite = True
            # one autocast region per minibatch: its cache casts each weight to bf16 once,
            # not once per micro-batch (the weights only change at the optimizer step)
            with autocast(settings.precision):
                for micro in torch.split(length_sorted(rows, batch), settings.micro_batch_size):
                    sequences = batch.sequences(micro, settings.pad_id)
                    width = sequences.input_ids.shape[1] - sequences.prompt_width
                    mask = batch.response_mask[micro, :width]
                    if settings.train_policy:
                        micro_diagnostics, micro_finite = _policy_micro_step(
                            policy_lm, sequences, batch, micro, width, mask, loss_cfg, counts,
                            settings.temperature, need_entropy_grad)
                        diagnostics = diagnostics.merge(micro_diagnostics)
                        finite &= micro_finite
                    if critic is not None:
                        value_terms.append(_critic_micro_step(
                            critic, sequences, batch, micro, width, mask, recipe, loss_cfg,
                            counts))
            metrics = diagnostics.finish()
            if settings.train_policy:
                max_norm = settings.max_grad_norm or float("inf")
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                metrics["grad/norm"] = float(norm)
                if finite and torch.isfinite(norm):
                    optimizer.step()
                else:  # guard: never let a NaN or inf reach the weights
                    optimizer.zero_grad(set_to_none=True)
                    metrics["guard/skipped_updates"] = 1.0
            if critic is not None:
                metrics["loss/value"] = sum(v for v, _ in value_terms)
                metrics["value/clip_frac"] = sum(c for _, c in value_terms)
                if math.isfinite(metrics["loss/value"]):
                    critic_optimizer.step()
                else:
                    critic_optimizer.zero_grad(set_to_none=True)
                    metrics["guard/skipped_updates"] = 1.0
            rounds.append(metrics)
    return average_rounds(rounds)


def _policy_micro_step(policy_lm, sequences, batch: TrainBatch, micro: Tensor, width: int,
                       mask: Tensor, loss_cfg: PolicyLossConfig, counts: BatchCounts,
                       temperature: float, need_entropy_grad: bool) -> tuple[Diagnostics, bool]:
    logp, entropy = response_logprobs(policy_lm, sequences, temperature, with_entropy=True,
                                      entropy_grad=need_entropy_grad)
    old = batch.old_logp[micro, :width] if batch.old_logp is not None else logp.detach()
    ref = batch.ref_logp[micro, :width] if batch.ref_logp is not None else None
    out = policy_loss(PolicyLossInputs(logp, old, batch.advantages[micro, :width], mask, ref,
                                       entropy), loss_cfg, counts)
    finite = bool(torch.isfinite(out.loss))
    if finite:
        out.loss.backward()
    return out.diagnostics, finite


def _critic_micro_step(critic, sequences, batch: TrainBatch, micro: Tensor, width: int,
                       mask: Tensor, recipe: Recipe, loss_cfg: PolicyLossConfig,
                       counts: BatchCounts) -> tuple[float, float]:
    """PPO's clipped value loss (ALGORITHMS.md §5), aggregated like the policy loss."""
    values = critic.values(sequences)
    per_token, clipped = clipped_value_loss(values, batch.old_values[micro, :width],
                                            batch.returns[micro, :width], recipe.value_clip)
    loss = aggregate(per_token, mask, loss_cfg.aggregation, counts, loss_cfg.norm_constant)
    (recipe.vf_coef * loss).backward()
    clip_share = aggregate(clipped.float(), mask, "token_mean", counts)
    return float(loss.detach()), float(clip_share)
