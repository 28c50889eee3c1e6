"""What an update holds fixed, filled in before it (the ``prepare`` phase of ``phases.py``):
old, reference and teacher log-probs, the critic's values, advantages and returns.

Everything here is a constant of the update, computed without a graph, micro-batch by
micro-batch; the teacher scores the same micro-batches as the reference, each row after the
teacher's own prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from postrl.config import TrainConfig
from postrl.models.logprobs import response_logprobs
from postrl.models.policy import ReferencePolicy, ValueModel
from postrl.models.precision import autocast, float32_module_autocast
from postrl.objectives.distill import distill_advantages, reverse_kl_tokens
from postrl.recipes import Recipe
from postrl.rollout.base import cat_right_padded
from postrl.train.batch import TrainBatch, compute_advantages
from postrl.train.micro_batches import micro_batches
from postrl.train.teacher import Teacher


@dataclass(frozen=True)
class Scorers:
    """The models ``prepare`` scores a batch with, on ``device``: the policy (the model the
    update differentiates), and the others, each None when the recipe has no use for it."""

    policy: Any
    reference: ReferencePolicy | None
    critic: ValueModel | None
    teacher: Teacher | None
    device: torch.device
    pad_id: int


def prepare(batch: TrainBatch, scorers: Scorers, recipe: Recipe, cfg: TrainConfig) -> None:
    """Fill in ``batch``'s constants of the update. Old log-probs are kept only when a batch
    gets more than one update (with one, every first ratio is 1), and computed also for a
    KL in the reward or the teacher's reverse KL, which both need the policy's own."""
    rows = torch.arange(batch.rows)
    kl_in_reward = recipe.needs_reference and recipe.kl_placement == "reward"
    proximal = recipe.old_policy == "proximal"
    needs_old = ((cfg.updates_per_batch > 1 and proximal) or kl_in_reward
                 or scorers.teacher is not None)
    parts: dict[str, list[torch.Tensor]] = {"old": [], "ref": [], "values": [], "teacher": []}
    device, pad_id = scorers.device, scorers.pad_id
    precision, device_type, temperature = cfg.precision, device.type, cfg.temperature
    with torch.no_grad():  # constants of the update: no graph kept for the whole batch
        for micro in micro_batches(rows, batch, cfg.micro_batch_size, cfg.micro_batch_tokens):
            sequences = batch.sequences(micro, pad_id).to(device)
            if needs_old:  # scored as the update will, so that its first ratios are 1
                with autocast(precision, device_type):
                    parts["old"].append(response_logprobs(scorers.policy, sequences,
                                                          temperature)[0])
            with float32_module_autocast(precision, device_type):
                if scorers.reference is not None:
                    parts["ref"].append(scorers.reference.logprobs(sequences, temperature))
                if scorers.critic is not None:
                    parts["values"].append(scorers.critic.values(sequences))
                if scorers.teacher is not None:
                    theirs = batch.sequences(micro, pad_id, batch.teacher_prompt_ids)
                    parts["teacher"].append(scorers.teacher.logprobs(theirs.to(device),
                                                                    temperature))
    width = batch.response_ids.shape[1]  # the batch stays on the CPU
    stacked = {k: cat_right_padded([t.cpu() for t in v], width=width)
               for k, v in parts.items() if v}
    old = stacked.get("old")
    batch.old_logp = old if cfg.updates_per_batch > 1 and proximal else None
    if not proximal:  # old_policy=behaviour: the sampler's log-probs are pi_old
        batch.old_logp, batch.sampler_logp = batch.sampler_logp, None
    batch.ref_logp = stacked.get("ref")
    batch.old_values = stacked.get("values")
    batch.advantages, batch.returns = compute_advantages(
        recipe, batch, recipe.kl_coef if kl_in_reward else 0.0, old)
    if scorers.teacher is not None:
        batch.teacher_logp = stacked["teacher"]
        batch.reverse_kl = reverse_kl_tokens(old, batch.teacher_logp, batch.response_mask)
        batch.advantages = batch.advantages + distill_advantages(batch.reverse_kl,
                                                                 recipe.distill_coef)
