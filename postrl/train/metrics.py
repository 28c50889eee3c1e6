"""The metrics of one training step, named as declared in ``postrl.telemetry.names``."""

from __future__ import annotations

import resource
import statistics
import sys
from dataclasses import dataclass

import torch

from postrl.objectives.distill import distill_metrics
from postrl.train.batch import TrainBatch
from postrl.train.sampling import Collected
from postrl.train.state import RunState


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def peak_memory_gb(device: torch.device) -> float:
    """On a GPU, the most memory PyTorch held there during this step (the trainer resets the
    peak at each step's start); on the CPU, this process's peak resident memory so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


@dataclass
class StepResult:
    """What one step made, for its metrics."""

    collected: Collected  # the step's groups: all generated, and those kept
    batch: TrainBatch | None  # what the update trained on (None: no group was kept)
    update: dict[str, float]  # the update's metrics
    timings: dict[str, float]  # seconds of each phase (generate, score, reference, ...)
    seconds: float  # the whole step's


def step_metrics(state: RunState, result: StepResult, lr: float, device: torch.device,
                 overlong_filter: bool) -> dict[str, float]:
    """The metrics of the step that brought the run to ``state``: its ``result``, the policy's
    learning rate ``lr`` (the schedule's, after the step), the peak memory on ``device``, and
    with ``overlong_filter`` how many rows that filter took out of the loss."""
    collected, batch, timings, step_seconds = (result.collected, result.batch, result.timings,
                                               result.seconds)
    kept = collected.groups
    rewards = [r for g in kept for r in g.rewards]
    correct = [c for g in kept for c in g.correct]
    lengths = [int(n) for g in kept for n in g.rollouts.generated_lengths]
    truncated = [r == "length" for g in kept for r in g.rollouts.finish_reasons]
    metrics: dict[str, float] = {
        "step": state.step,
        "rollout/tokens_generated": state.tokens_generated,
        "rollout/tokens_wasted": state.tokens_wasted,
        "rollout/responses": state.responses,
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
        "lr": lr,
        "time/generate_s": timings["generate"],
        "time/score_s": timings["score"],
        "time/reference_s": timings["reference"],
        "time/train_s": timings["train"],
        "time/sync_s": timings["sync"],
        "time/step_s": step_seconds,
        "throughput/tokens_per_s": collected.tokens_generated / max(step_seconds, 1e-9),
        "memory/peak_gb": peak_memory_gb(device),
    }
    prefilled = [g.rollouts.prefill_lengths for g in collected.generated]
    if prefilled and all(p is not None for p in prefilled):  # the engine counts them
        metrics["rollout/prefill_tokens"] = int(sum(int(p.sum()) for p in prefilled))
    for name in kept[0].per_function if kept else ():
        values = [v for g in kept for v in g.per_function[name] if v is not None]
        metrics[f"reward/{name}/mean"] = _mean(values)
    if batch is not None:
        mask = batch.response_mask
        valid_advantages = batch.advantages[mask]
        metrics["advantage/mean"] = float(valid_advantages.mean()) if mask.any() else 0.0
        metrics["advantage/abs_mean"] = (float(valid_advantages.abs().mean())
                                         if mask.any() else 0.0)
        if overlong_filter:
            metrics["batch/overlong_filtered"] = int(batch.truncated.sum())
        if batch.reverse_kl is not None:
            metrics.update(distill_metrics(batch.reverse_kl, batch.teacher_logp, mask))
    metrics.update(episode_metrics(collected))
    metrics.update(result.update)
    return metrics


def episode_metrics(collected: Collected) -> dict[str, float]:
    """Turns, tools and environment cost of the step's episodes (every one generated);
    nothing for single-turn rollouts."""
    stats = [g.rollouts.episodes for g in collected.generated if g.rollouts.episodes]
    if not stats:
        return {}
    def flat(name: str) -> list:
        return [v for s in stats for v in getattr(s, name)]
    return {"episode/turns_mean": _mean(flat("turns")),
            "episode/out_of_turns_frac": _mean([float(v) for v in flat("out_of_turns")]),
            "episode/env_tokens_mean": _mean(flat("env_tokens")),
            "episode/tool_calls": sum(flat("tool_calls")),
            "episode/tool_errors": sum(flat("tool_errors")),
            "time/env_s": sum(flat("env_seconds"))}


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
                         "length": int(group.rollouts.generated_lengths[j]),
                         "finish_reason": group.rollouts.finish_reasons[j]})
    return rows
