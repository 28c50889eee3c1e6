"""What a checkpoint holds, and how a run continues from one exactly (docs/reliability.md)."""

from __future__ import annotations

import dataclasses
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.recipes import Recipe
from postrl.telemetry import RunDir
from postrl.train.checkpoint import is_valid, latest_valid, load_checkpoint, save_checkpoint
from postrl.train.state import RunObjects, RunState

# options that may change between a run and its resumption without changing its results
# (``out``: a run directory may be moved, or named by another path, and continued)
RESUMABLE_CHANGES = {"out", "resume", "overwrite", "steps", "token_budget", "quiet", "report_to",
                     "save_every", "keep_last", "eval_every", "eval_n", "eval_samples",
                     "log_samples", "save_rollouts_every", "threads", "reuse_freed_memory",
                     "torch_compile", "gradient_checkpointing", "reuse_sampler_forward",
                     "device", "vllm_gpu_memory_utilization", "vllm_enforce_eager",
                     "vllm_kv_cache_gb", "overlap_sampling"}


def checkpoint_state(objects: RunObjects, state: RunState, cfg: TrainConfig) -> dict[str, Any]:
    """Everything needed to continue exactly: weights, optimizers, RNG, sampler, counters.
    (The reference policy is not saved: it is rebuilt from the initial model.)"""
    return {
        "policy": objects.policy.state_dict(),
        "critic": objects.critic.state_dict() if objects.critic else None,
        "optimizer": objects.optimizer.state_dict(),
        "critic_optimizer": (objects.critic_optimizer.state_dict()
                             if objects.critic_optimizer else None),
        "scheduler": objects.scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "update_generator": objects.update_generator.get_state()},
        "sampler": dict(zip(("epoch", "position"), objects.queue.position or (
            objects.sampler.epoch, objects.sampler.position), strict=True)),
        "queue": objects.queue.saved(),
        "counters": state.counters(),
        "config": cfg.resolved(),
    }


def restore(objects: RunObjects, saved: dict[str, Any], where: str) -> RunState:
    """Load a checkpoint's ``saved`` state into ``objects`` and the RNGs; its run state."""
    objects.policy.load_state_dict(saved["policy"])
    if objects.critic is not None:
        objects.critic.load_state_dict(saved["critic"])
        objects.critic_optimizer.load_state_dict(saved["critic_optimizer"])
    objects.optimizer.load_state_dict(saved["optimizer"])
    objects.scheduler.load_state_dict(saved["scheduler"])
    random.setstate(saved["rng"]["python"])
    np.random.set_state(saved["rng"]["numpy"])
    torch.set_rng_state(saved["rng"]["torch"])
    objects.update_generator.set_state(saved["rng"]["update_generator"])
    objects.sampler.restore(saved["sampler"]["epoch"], saved["sampler"]["position"])
    objects.queue.load(saved.get("queue", []))  # older checkpoints: none
    return RunState.from_counters(saved["counters"], where)


def check_same_run(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """A resumed run must be the same run: refuse changed options that change results. An
    option the checkpoint does not know (added to postrl since) is the same when it has its
    default, which is what the saved run ran with."""
    changed = _changes(saved, current, _defaults(TrainConfig), "")
    changed += _changes(saved.get("resolved_recipe") or {}, current.get("resolved_recipe") or {},
                        _defaults(Recipe), "resolved_recipe.")
    if changed:
        details = "; ".join(changed)
        raise ConfigError(f"cannot resume from {where}: the run's options changed ({details}); "
                          "resume with the original options, or start a new run")


def _defaults(cls: type) -> dict[str, Any]:
    fields = dataclasses.fields(cls)
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in fields if f.default is not dataclasses.MISSING
            or f.default_factory is not dataclasses.MISSING}


def _changes(saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any],
             prefix: str) -> list[str]:
    changes = []
    for key in sorted(set(saved) | set(current)):
        if key in RESUMABLE_CHANGES or key == "resolved_recipe":
            continue
        before = saved.get(key, defaults.get(key))
        if before != current.get(key):
            changes.append(f"{prefix}{key}: {saved.get(key)!r} -> {current.get(key)!r}")
    return changes


def checkpoint_to_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``cfg.resume`` names: the newest valid one (``auto``; None if there is
    none), or the directory named, absolute or under ``checkpoints/``, which must be valid."""
    root = cfg.run_dir() / "checkpoints"
    if cfg.resume == "auto":
        return latest_valid(root)
    candidates = [p for p in (root / cfg.resume, Path(cfg.resume)) if p.is_dir()]
    if not candidates:
        raise ConfigError(f"resume={cfg.resume!r}: no such checkpoint directory (looked in "
                          f"{root} and {Path(cfg.resume).resolve()})")
    valid, why = is_valid(candidates[0])
    if not valid:
        raise ConfigError(f"resume={cfg.resume!r}: checkpoint {candidates[0]} is not usable: "
                          f"{why}; resume=auto continues from the newest valid one")
    return candidates[0]


def resume(objects: RunObjects, cfg: TrainConfig, run: RunDir, path: Path | None
           ) -> RunState | None:
    """Load the checkpoint at ``path`` (from :func:`checkpoint_to_resume`) into ``objects``
    and drop any metrics and samples ``run`` logged after it. Returns the state resumed;
    None (no checkpoint) starts from scratch, keeping the logs of the attempt before in
    ``earlier/``."""
    if path is None:
        kept = run.keep_as_earlier()
        if kept is not None:
            why = ("it saves none: save_every=0" if not cfg.save_every
                   else "none was saved before it stopped, or none is valid")
            warnings.warn(f"resume={cfg.resume}: {run.path} holds no checkpoint "
                          f"to continue from ({why}); training starts from step 0, and the "
                          f"logs of the attempt before are kept in {kept}", stacklevel=2)
        return None
    saved = load_checkpoint(path)
    check_same_run(saved["config"], cfg.resolved(), str(path))
    state = restore(objects, saved, str(path))
    run.truncate_after(state.step)
    return state


def maybe_save(objects: RunObjects, state: RunState, cfg: TrainConfig, run: RunDir,
               final: bool = False) -> None:
    """A checkpoint of the run in ``run`` when one is due: every ``save_every`` steps, and at
    the ``final`` one."""
    every = cfg.save_every
    if every and (state.step % every == 0 or final) and state.step > 0:
        save_checkpoint(run.path / "checkpoints", state.step, checkpoint_state(objects, state, cfg),
                        cfg.keep_last)


def interrupted_note(run: RunDir | None, save_every: int, restored_earlier: bool = False) -> str:
    """What an interrupted training left in ``run`` (None: no trainer was made), and how to
    continue it (for the CLI's message); ``restored_earlier``: the trainer put back an
    earlier run that it was overwriting."""
    if run is None:
        return "training had not started: nothing was written"
    if restored_earlier:
        return (f"no step had finished; the earlier run in {run.path} was put back as "
                "it was")
    logged = run.read_metrics() if run.metrics_path.exists() else []
    done = f"{logged[-1]['step'] if logged else 0} steps are logged in {run.metrics_path}"
    newest = latest_valid(run.path / "checkpoints")
    if newest is None:
        why = ("save_every=0 saves none" if not save_every
               else f"save_every={save_every}: none was due yet")
        return (f"{done}; no checkpoint was saved ({why}), so this run cannot be continued: "
                "start it again")
    return (f"{done}; the newest checkpoint is {newest.name}: continue with the same options "
            "and resume=auto")
