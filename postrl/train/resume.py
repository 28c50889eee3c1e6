"""What a checkpoint holds, and how a run continues from one exactly (docs/reliability.md)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from postrl.errors import ConfigError
from postrl.train.checkpoint import latest_valid, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from postrl.train.trainer import Trainer

# options that may change between a run and its resumption without changing its results
RESUMABLE_CHANGES = {"resume", "overwrite", "steps", "token_budget", "quiet", "report_to",
                     "save_every", "keep_last", "eval_every", "eval_n", "log_samples",
                     "save_rollouts_every", "threads", "reuse_freed_memory",
                     "torch_compile", "reuse_sampler_forward"}
COUNTERS = ("step", "tokens_generated", "tokens_wasted", "responses", "skipped_steps",
            "skipped_in_a_row")


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Everything needed to continue exactly: weights, optimizers, RNG, sampler, counters.
    (The reference policy is not saved: it is rebuilt from the initial model.)"""
    return {
        "policy": trainer.lm.state_dict(),
        "critic": trainer.critic.state_dict() if trainer.critic else None,
        "optimizer": trainer.optimizer.state_dict(),
        "critic_optimizer": (trainer.critic_optimizer.state_dict()
                             if trainer.critic_optimizer else None),
        "scheduler": trainer.scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "update_generator": trainer.update_generator.get_state()},
        "sampler": {"epoch": trainer.sampler.epoch, "position": trainer.sampler.position},
        "counters": {name: getattr(trainer, name) for name in COUNTERS},
        "config": trainer.cfg.resolved(),
    }


def restore(trainer: Trainer, state: dict[str, Any]) -> None:
    trainer.lm.load_state_dict(state["policy"])
    if trainer.critic is not None:
        trainer.critic.load_state_dict(state["critic"])
        trainer.critic_optimizer.load_state_dict(state["critic_optimizer"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    trainer.update_generator.set_state(state["rng"]["update_generator"])
    trainer.sampler.restore(state["sampler"]["epoch"], state["sampler"]["position"])
    for name, value in state["counters"].items():
        setattr(trainer, name, value)


def check_same_run(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """A resumed run must be the same run: refuse changed options that change results."""
    changed = sorted(k for k in set(saved) | set(current)
                     if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
    if changed:
        details = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise ConfigError(f"cannot resume from {where}: the run's options changed ({details}); "
                          "resume with the original options, or start a new run")


def resume(trainer: Trainer) -> int | None:
    """Load the newest valid checkpoint (``resume=auto``) or the one named; drop any
    metrics and samples logged after it. Returns the step resumed from, None if none."""
    root = trainer.run.path / "checkpoints"
    option = trainer.cfg.resume
    if option == "auto":
        path = latest_valid(root)
    else:  # a checkpoint named by its directory, absolute or under checkpoints/
        candidates = [p for p in (root / option, Path(option)) if p.is_dir()]
        if not candidates:
            raise ConfigError(f"resume={option!r}: no such checkpoint directory")
        path = candidates[0]
    if path is None:
        trainer.run.truncate_after(0)
        return None
    state = load_checkpoint(path)
    check_same_run(state["config"], trainer.cfg.resolved(), str(path))
    restore(trainer, state)
    trainer.run.truncate_after(trainer.step)
    return trainer.step


def maybe_save(trainer: Trainer, final: bool = False) -> None:
    every = trainer.cfg.save_every
    if every and (trainer.step % every == 0 or final) and trainer.step > 0:
        save_checkpoint(trainer.run.path / "checkpoints", trainer.step, trainer_state(trainer),
                        trainer.cfg.keep_last)
