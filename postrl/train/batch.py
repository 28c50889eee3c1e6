"""From kept groups to the tensors of one training batch: shaping, filters, advantages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from postrl.models.backend import KeptRows
from postrl.models.logprobs import SequenceBatch
from postrl.objectives import advantages as adv
from postrl.objectives import kl_penalty
from postrl.recipes import Recipe
from postrl.rollout.base import cat_right_padded
from postrl.tasks import Example
from postrl.train.sampling import Group


@dataclass
class TrainBatch:
    """``N = groups * G`` rows, right-padded ``[N, T]``; groups adjacent, in order."""

    prompt_ids: list[list[int]]
    response_ids: Tensor
    response_mask: Tensor  # bool, after overlong filtering
    rewards: Tensor  # [N] total reward after shaping
    correct: Tensor  # [N] bool
    lengths: Tensor  # [N] each row's tokens (generated; an episode's environment tokens too)
    truncated: Tensor  # [N] bool: hit max_new_tokens
    group_size: int
    old_logp: Tensor | None = None  # only when a batch gets more than one update
    ref_logp: Tensor | None = None  # only when a KL term is on
    old_values: Tensor | None = None  # PPO
    advantages: Tensor | None = None
    returns: Tensor | None = None
    # the sampler's per-token entropies, when its backend reports them: the diagnostics of
    # rows the update does not score (``postrl.train.update``)
    sampler_entropy: Tensor | None = None
    # the sampler's log-prob of each token it drew (the behaviour policy; 0 off-mask): the
    # mismatch between sampler and trainer is measured and corrected against it
    sampler_logp: Tensor | None = None
    # the rows' share of what the backend kept of sampling them, when it kept some for every
    # row (a record of the sampler's forward, which the update's reads while fresh): opaque
    kept_rows: KeptRows | None = None
    # multi-turn episodes: the environment's tokens, attended to but never trained on
    env_mask: Tensor | None = None
    # env_reward_at=turn: [N, T] the part of ``rewards`` paid turn by turn, at each turn's
    # last model token (token-level advantages place the rest at the end)
    turn_rewards: Tensor | None = None
    # on-policy distillation: each row's prompt as the teacher reads it, the teacher's
    # log-prob of each response token, and log pi_old - log pi_teacher (0 off-mask)
    teacher_prompt_ids: list[list[int]] | None = None
    teacher_logp: Tensor | None = None
    reverse_kl: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.response_ids.shape[0]

    def sequences(self, rows: Tensor, pad_id: int,
                  prompt_ids: list[list[int]] | None = None) -> SequenceBatch:
        """The forward-pass input of some rows (:func:`response_sequences`); ``prompt_ids``
        puts other prompts before the same responses (a teacher's)."""
        prompts = self.prompt_ids if prompt_ids is None else prompt_ids
        sequences = response_sequences([prompts[i] for i in rows.tolist()],
                                       self.response_ids[rows], self.response_mask[rows],
                                       self.lengths[rows], self.env_mask is not None, pad_id)
        if self.kept_rows is not None and prompt_ids is None:  # the sampler's own prompts
            sequences.kept_rows = self.kept_rows.take(rows)
        return sequences


def response_sequences(prompt_ids: list[list[int]], response_ids: Tensor, response_mask: Tensor,
                       lengths: Tensor, episodes: bool, pad_id: int) -> SequenceBatch:
    """Rows as a forward pass reads them, trimmed to their longest response. The environment's
    tokens of an episode are in the context (the model's later turns saw them); which tokens
    are trained on is the response mask's business, not this."""
    width = max(int(lengths.max()), 1)
    trained = response_mask[:, :width]
    context, scored = trained, None
    if episodes:  # the whole episode, even a row filtered out of the loss
        context = torch.arange(width) < lengths.unsqueeze(1)
        scored = trained
    return SequenceBatch.build(prompt_ids, response_ids[:, :width], context, pad_id, scored)


def assemble(groups: list[Group], overlong_filter: bool,
             teacher_prompt: Callable[[Example], list[int]] | None = None) -> TrainBatch:
    """Concatenate groups; with overlong filtering (DAPO §3.4) truncated rows get mask 0.
    ``teacher_prompt`` gives each example's prompt as a distillation teacher reads it."""
    def cat(name: str, fill) -> Tensor:
        return cat_right_padded([getattr(g.rollouts, name) for g in groups], fill)

    truncated = torch.tensor([r == "length" for g in groups for r in g.rollouts.finish_reasons])
    reported = all(g.rollouts.entropies is not None for g in groups)
    episodes = any(g.rollouts.env_mask is not None for g in groups)
    mask = cat("response_mask", False)
    if overlong_filter:
        mask = mask & ~truncated.unsqueeze(1)
    return TrainBatch(
        prompt_ids=[p for g in groups for p in g.rollouts.prompt_ids],
        response_ids=cat("response_ids", 0),
        response_mask=mask,
        rewards=torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
        correct=torch.tensor([c for g in groups for c in g.correct]),
        lengths=torch.cat([g.rollouts.lengths for g in groups]),
        truncated=truncated,
        group_size=groups[0].rollouts.group_size,
        sampler_entropy=cat("entropies", 0.0) if reported else None,
        sampler_logp=cat("logprobs", 0.0),
        kept_rows=_kept_rows(groups),
        env_mask=cat("env_mask", False) if episodes else None,
        turn_rewards=(cat_right_padded([g.turn_rewards for g in groups], 0.0)
                      if groups[0].turn_rewards is not None else None),
        teacher_prompt_ids=(None if teacher_prompt is None else
                            [teacher_prompt(g.example) for g in groups for _ in g.rewards]),
    )


def _kept_rows(groups: list[Group]) -> KeptRows | None:
    """The groups' rows of the one thing the backend kept of sampling them all (None where
    it kept none, or several)."""
    parts = [g.rollouts.kept_rows for g in groups]
    if not parts or any(p is None for p in parts):
        return None
    return parts[0].join(parts)


def compute_advantages(recipe: Recipe, batch: TrainBatch, kl_coef_in_reward: float,
                       old_logp: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Per-token advantages ``[N, T]`` (0 off-mask) and, for GAE, the returns. Branches on
    the advantage component only (docs/algorithms.md §1)."""
    mask = batch.response_mask
    rewards = batch.rewards
    penalty = None
    if kl_coef_in_reward:  # PPO / InstructGPT: -beta * KL per token in the token rewards
        penalty = kl_coef_in_reward * kl_penalty(old_logp, batch.ref_logp, recipe.kl_estimator)
        penalty = penalty * mask
    if recipe.advantage in ("group", "rloo"):
        per_response = (adv.group(rewards, batch.group_size, recipe.adv_scale, recipe.adv_std,
                                  recipe.adv_eps)
                        if recipe.advantage == "group" else adv.rloo(rewards, batch.group_size))
        return per_response.unsqueeze(1) * mask, None
    if recipe.advantage == "reinforce_pp_baseline":
        return adv.reinforce_pp_baseline(rewards, batch.group_size, mask.float(), penalty,
                                         recipe.gamma, recipe.whiten_advantages), None
    if batch.turn_rewards is None:
        token_rewards = adv.outcome_token_rewards(rewards, mask)
    else:  # env_reward_at=turn: each turn's pay where the turn ended, the rest at the end
        token_rewards = (adv.outcome_token_rewards(rewards - batch.turn_rewards.sum(1), mask)
                         + batch.turn_rewards * mask)
    if penalty is not None:
        token_rewards = token_rewards - penalty
    if recipe.advantage == "reinforce_pp":
        return adv.reinforce_pp(token_rewards, mask, recipe.gamma, recipe.whiten_advantages), None
    return adv.gae(token_rewards, batch.old_values, mask, recipe.gamma, recipe.lam,
                   recipe.whiten_advantages)


def save_rollout_batch(batch: TrainBatch, path: Path, config: dict[str, Any]) -> None:
    """Freeze a batch (tokens, masks, rewards, advantages, log-probs) for ``postrl replay``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
              if f.name != "kept_rows"}  # the backend's, in this process only
    temporary = path.with_suffix(".tmp")
    torch.save({"batch": fields, "config": config}, temporary)
    temporary.replace(path)


def load_rollout_batch(path: Path) -> tuple[TrainBatch, dict[str, Any]]:
    """The batch and the resolved config of the run that saved it."""
    saved = torch.load(path, weights_only=False)
    return TrainBatch(**saved["batch"]), saved["config"]  # older saves: no sampler_logp
