"""A supervised warm start from the teacher's own samples (``teacher.warm_start_prompts``).

Before the first step the teacher, reading its own prompt (e.g. with worked demonstrations),
plays ``group_size`` episodes of each of the first ``warm_start_prompts`` training problems;
those the task's verifier accepts become targets for the student after the student's own
prompt, and ``warm_start_steps`` optimizer steps lower their mean negative log-likelihood per
token (the model's tokens only: an episode's environment tokens stay context). That is
sequence-level context distillation (Snell et al. 2022, "Learning by Distilling Context",
arXiv 2209.15189) filtered by the verifier, i.e. rejection sampling (RFT: Yuan et al. 2023,
arXiv 2308.01825).

Why before on-policy distillation (docs/algorithms.md §11): the reverse KL's gradient on a
token is proportional to the student's probability of it, so a behaviour the student never
samples (a tool call, for a model that was never shown one) is taught slowly or not at all;
a few supervised steps on the teacher's samples make it likely, and the dense per-token signal
then refines it on the student's own samples. The teacher's tokens count as generated tokens:
a comparison at equal budget pays for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from postrl.config import TrainConfig
from postrl.models.logprobs import response_logprobs
from postrl.rollout import SamplingParams
from postrl.rollout.episodes import EpisodeLimits
from postrl.tasks import Example, task_prompt
from postrl.train.batch import response_sequences
from postrl.train.evaluate import Sampler
from postrl.train.grading import Grader
from postrl.train.sampling import Collected
from postrl.train.teacher import Teacher

SEED_OFFSET = 104_729  # the warm start's sampling stream, apart from every step's


@dataclass(frozen=True)
class WarmStart:
    """What the warm start reads: an engine that samples the teacher's weights now (the
    student's own engine for ``teacher.model=self``, before any update), the teacher's prompts,
    the run's grader, the student's prompt of an example, and the episodes' limits (None:
    single-turn)."""

    engine: Any
    teacher: Teacher
    grader: Grader
    student_prompt: Callable[[Example], list[int]]
    episodes: EpisodeLimits | None
    pad_id: int


def warm_start(parts: WarmStart, lm: torch.nn.Module, sampling: SamplingParams,
               cfg: TrainConfig) -> tuple[dict[str, float], Collected]:
    """Train ``lm`` on the teacher's accepted samples; ``(metrics, what was sampled)``."""
    started = time.perf_counter()
    teacher, group = parts.teacher, cfg.group_size
    examples = list(teacher.task.train())[: cfg.teacher.warm_start_prompts]
    prompts = [task_prompt(teacher.tokenizer, teacher.task, e.question, teacher.system_prompt)
               for e in examples]
    sampler = Sampler(parts.engine, teacher.tokenizer,
                      None if parts.episodes is None else (teacher.task, parts.episodes))
    rollouts = sampler.rollouts(examples, [teacher.prompt_ids(e) for e in examples], group,
                                sampling, (cfg.seed + SEED_OFFSET) % 2**31)
    groups, _ = parts.grader.groups(examples, prompts, rollouts)
    kept = [row for row in range(len(rollouts.texts)) if groups[row // group].correct[row % group]]
    metrics = {"warm_start/samples": len(rollouts.texts), "warm_start/kept": len(kept),
               "warm_start/tokens": rollouts.num_tokens}
    if kept:
        targets = [(parts.student_prompt(examples[row // group]), row) for row in kept]
        losses = _fit(lm, rollouts, targets, parts.pad_id, cfg)
        metrics |= {"warm_start/nll_first": losses[0], "warm_start/nll_last": losses[-1]}
    metrics["time/warm_start_s"] = time.perf_counter() - started
    return metrics, Collected(groups=groups, generated=groups, rounds=1)


def _fit(lm: torch.nn.Module, rollouts, targets: list[tuple[list[int], int]], pad_id: int,
         cfg: TrainConfig) -> list[float]:
    """``warm_start_steps`` AdamW steps (the run's lr, betas and weight decay; an optimizer of
    its own, dropped after) on the mean NLL per model token of ``targets`` (``(student prompt,
    row of rollouts)``), in micro-batches of ``micro_batch_size`` rows; each step's loss."""
    parameters = [p for p in lm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                  weight_decay=cfg.weight_decay)
    episodes = rollouts.env_mask is not None
    device = next(lm.parameters()).device
    chunks = [targets[i : i + cfg.micro_batch_size]
              for i in range(0, len(targets), cfg.micro_batch_size)]
    tokens = sum(int(rollouts.response_mask[row].sum()) for _, row in targets)
    losses = []
    lm.train()
    for _ in range(cfg.teacher.warm_start_steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            rows = torch.tensor([row for _, row in chunk])
            batch = response_sequences([prompt for prompt, _ in chunk],
                                       rollouts.response_ids[rows], rollouts.response_mask[rows],
                                       rollouts.lengths[rows], episodes, pad_id).to(device)
            logp = response_logprobs(lm, batch, cfg.temperature)[0]
            mask = rollouts.response_mask[rows][:, : logp.shape[1]].to(device)
            loss = -(logp * mask).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(parameters, cfg.max_grad_norm)
        optimizer.step()
        losses.append(total)
    optimizer.zero_grad(set_to_none=True)
    return losses
