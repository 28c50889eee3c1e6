"""Rollouts to scored groups: the weighted rewards, DAPO's overlong shaping, the verifier's
verdict, and where an episode's environment rewards fall (``env_reward_at``)."""

from __future__ import annotations

from dataclasses import dataclass

from postrl.config import TrainConfig
from postrl.envs.base import is_environment_task
from postrl.errors import ConfigError
from postrl.recipes import Recipe
from postrl.rewards import Scorer, load_reward, soft_overlong_penalty
from postrl.rewards.base import RewardFunction
from postrl.rollout import Rollouts
from postrl.rollout.base import select_rows
from postrl.rollout.episodes import turn_reward_tensor
from postrl.train.sampling import Group
from postrl.train.setup import reward_specs

ENVIRONMENT = "environment"  # the reward that reads an episode's env_reward column


@dataclass
class Grader:
    """Scores a round's rollouts into one :class:`Group` per example. ``turn_weight``: with
    ``env_reward_at=turn``, the ``environment`` reward's weight, and each step's reward is
    placed at the turn it answered (None: the episode's total reward is at its end)."""

    scorer: Scorer
    verifier_name: str
    verifier: RewardFunction
    recipe: Recipe
    group_size: int
    max_new_tokens: int
    turn_weight: float | None = None

    @classmethod
    def for_run(cls, cfg: TrainConfig, task, recipe: Recipe, device: str) -> Grader:
        scorer = Scorer(reward_specs(cfg.rewards, task.default_rewards),
                        on_error=cfg.reward_errors, timeout_s=cfg.reward_timeout_s).place(device)
        verifier_name = task.default_rewards[0]
        return cls(scorer, verifier_name, load_reward(verifier_name), recipe, cfg.group_size,
                   cfg.max_new_tokens, _turn_weight(cfg, task, scorer))

    def groups(self, examples, prompts: list[str], rollouts: Rollouts) -> tuple[list[Group], int]:
        """The groups, and how many reward values failed and were scored 0."""
        g = self.group_size
        row_prompts = [p for p in prompts for _ in range(g)]
        columns = {key: [e.columns.get(key) for e in examples for _ in range(g)]
                   for key in {k for e in examples for k in e.columns}}
        if rollouts.episodes is not None:  # read by the reward "environment"
            columns["env_reward"] = list(rollouts.episodes.rewards)
        scored = self.scorer.score(row_prompts, rollouts.texts, columns)
        per_function = dict(scored.per_function)
        totals = list(scored.total)
        if self.recipe.overlong_penalty:  # DAPO eq. 13, added to the outcome reward
            penalty = soft_overlong_penalty(rollouts.generated_lengths.tolist(),
                                            self.max_new_tokens, self.recipe.overlong_buffer,
                                            self.recipe.overlong_penalty_factor)
            per_function["overlong_penalty"] = penalty
            totals = [t + p for t, p in zip(totals, penalty, strict=True)]
        verdict = per_function.get(self.verifier_name) or self.verifier(
            row_prompts, rollouts.texts, **columns)
        placed = (None if self.turn_weight is None
                  else turn_reward_tensor(rollouts, self.turn_weight))
        groups = []
        for i, example in enumerate(examples):
            rows = slice(i * g, (i + 1) * g)
            group_rollouts = select_rows(rollouts, rows.start, rows.stop)
            groups.append(Group(
                example=example, prompt_text=prompts[i], rollouts=group_rollouts,
                rewards=totals[rows], per_function={k: v[rows] for k, v in per_function.items()},
                correct=[v == 1.0 for v in verdict[rows]],
                turn_rewards=(None if placed is None else
                              placed[rows, :group_rollouts.response_ids.shape[1]])))
        return groups, scored.errors


def _turn_weight(cfg: TrainConfig, task, scorer: Scorer) -> float | None:
    """The ``environment`` reward's weight when ``env_reward_at=turn`` (None otherwise); a
    ConfigError when there are no turns or no environment reward to place."""
    if cfg.env_reward_at == "end":
        return None
    if not is_environment_task(task):
        raise ConfigError(f"env_reward_at=turn: task {cfg.task!r} is single-turn (it has no "
                          "environment whose steps pay rewards); use env_reward_at=end")
    weights = {r.name: r.weight for r in scorer.rewards}
    if ENVIRONMENT not in weights:
        raise ConfigError("env_reward_at=turn places the reward 'environment' turn by turn, "
                          f"but rewards={list(weights)} does not include it")
    return weights[ENVIRONMENT]
