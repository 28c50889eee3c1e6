"""The metrics of one training step, named as declared in ``postrl.telemetry.names``."""

from __future__ import annotations

import resource
import statistics
import sys
from typing import TYPE_CHECKING

import torch

from postrl.train.batch import TrainBatch
from postrl.train.sampling import Collected

if TYPE_CHECKING:
    from postrl.train.trainer import Trainer


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def peak_memory_gb(device: torch.device) -> float:
    """On a GPU, the most memory PyTorch held there during this step (the trainer resets the
    peak at each step's start); on the CPU, this process's peak resident memory so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def step_metrics(trainer: Trainer, collected: Collected, batch: TrainBatch | None,
                 update: dict[str, float], timings: dict[str, float],
                 step_seconds: float) -> dict[str, float]:
    kept = collected.groups
    rewards = [r for g in kept for r in g.rewards]
    correct = [c for g in kept for c in g.correct]
    lengths = [int(n) for g in kept for n in g.rollouts.lengths]
    truncated = [r == "length" for g in kept for r in g.rollouts.finish_reasons]
    metrics: dict[str, float] = {
        "step": trainer.step,
        "rollout/tokens_generated": trainer.tokens_generated,
        "rollout/tokens_wasted": trainer.tokens_wasted,
        "rollout/responses": trainer.responses,
        "rollout/sampling_rounds": collected.rounds,
        "reward/mean": _mean(rewards),
        "reward/std": statistics.pstdev(rewards) if rewards else float("nan"),
        "accuracy/mean": _mean([float(c) for c in correct]),
        "batch/zero_variance_frac": _mean([float(g.zero_variance) for g in collected.generated]),
        "batch/groups_kept": len(kept),
        "length/mean": _mean(lengths),
        "length/max": max(lengths, default=0),
        "length/correct_mean": _mean([n for n, c in zip(lengths, correct, strict=True) if c]),
        "length/incorrect_mean": _mean([n for n, c in zip(lengths, correct, strict=True)
                                        if not c]),
        "length/truncated_frac": _mean([float(t) for t in truncated]),
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "time/generate_s": timings["generate"],
        "time/score_s": timings["score"],
        "time/reference_s": timings["reference"],
        "time/train_s": timings["train"],
        "time/step_s": step_seconds,
        "throughput/tokens_per_s": collected.tokens_generated / max(step_seconds, 1e-9),
        "memory/peak_gb": peak_memory_gb(trainer.device),
    }
    for name in kept[0].per_function if kept else ():
        values = [v for g in kept for v in g.per_function[name] if v is not None]
        metrics[f"reward/{name}/mean"] = _mean(values)
    if batch is not None:
        mask = batch.response_mask
        valid_advantages = batch.advantages[mask]
        metrics["advantage/mean"] = float(valid_advantages.mean()) if mask.any() else 0.0
        metrics["advantage/abs_mean"] = (float(valid_advantages.abs().mean())
                                         if mask.any() else 0.0)
        if trainer.recipe.overlong_filter:
            metrics["batch/overlong_filtered"] = int(batch.truncated.sum())
    metrics.update(update)
    return metrics


def sample_rows(collected: Collected, limit: int) -> list[dict]:
    """The first ``limit`` completions of a step, as ``samples.jsonl`` records them."""
    rows = []
    for group in collected.generated:
        for j in range(len(group.rewards)):
            if len(rows) == limit:
                return rows
            rows.append({"id": group.example.id, "prompt": group.example.question,
                         "completion": group.rollouts.texts[j], "reward": group.rewards[j],
                         "rewards": {k: v[j] for k, v in group.per_function.items()},
                         "correct": group.correct[j],
                         "length": int(group.rollouts.lengths[j]),
                         "finish_reason": group.rollouts.finish_reasons[j]})
    return rows
