"""The run directory ``runs/NAME/``: everything one training run leaves behind.

::

    runs/NAME/
      config.yaml      the fully resolved configuration (write_config)
      metrics.jsonl    one line per optimizer step (JsonlSink on metrics_path)
      samples.jsonl    a few prompts, completions and rewards per step (append_samples)
      final/           the trained policy as a Hugging Face directory (final_dir)
      tensorboard/ wandb/ mlruns/   optional trackers (report_to)

``RunDir(path)`` only names the files and never touches the disk, so finished runs can be
read with it. A training run starts with :meth:`RunDir.create`, which refuses to mix a new
run into an old one. With ``overwrite``, the earlier run's outputs are moved aside into
``.postrl-replaced/`` and deleted only once the new run has logged its first step
(:meth:`RunDir.commit_replacement`); a run that fails before that puts them back
(:meth:`RunDir.restore_replaced`), and one killed before that has them put back by the next
:meth:`RunDir.create` there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from postrl.errors import ConfigError
from postrl.telemetry.jsonl import append_records, jsonable, read_records

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
FINAL_DIR = "final"
TRACKER_DIRS = ("tensorboard", "wandb", "mlruns")
EARLIER_DIR = "earlier"  # logs of attempts that resume=auto could not continue
REPLACED_DIR = ".postrl-replaced"  # an earlier run's outputs while overwrite replaces them

# What `overwrite=True` removes: only what postrl itself writes into a run directory.
# Anything else a user put there (notes, their own files) is left alone.
RUN_OUTPUTS: tuple[str, ...] = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, FINAL_DIR, *TRACKER_DIRS,
                                 "checkpoints", "rollouts", EARLIER_DIR)


class RunDir:
    """Paths and writers for one run directory."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, path: Path | str, *, overwrite: bool = False, resume: bool = False) -> RunDir:
        """Prepare ``path`` for a new run (or for resuming one) and return it.

        A directory whose ``metrics.jsonl`` holds a step belongs to an earlier run:
        without ``overwrite`` or ``resume`` this raises ConfigError naming the path and the
        ``overwrite`` option. ``overwrite=True`` moves postrl's own outputs there
        (:data:`RUN_OUTPUTS`) aside, and nothing else; ``resume=True`` keeps them, so new
        steps are appended to the same files. Call it only with the directory locked
        (:class:`~postrl.telemetry.run_lock.RunLock`).
        """
        if overwrite and resume:
            raise ConfigError("overwrite and resume exclude each other: set at most one")
        run = cls(path)
        check_out_path(run.path)
        make_run_directory(run.path)
        run.restore_replaced()  # an overwrite killed before its first step: put the run back
        run.check_can_start(overwrite, resume)
        if overwrite:
            run._move_outputs(run.path, run.path / REPLACED_DIR)
        return run

    def check_can_start(self, overwrite: bool, resume: bool) -> None:
        """ConfigError if a new run here would mix with an earlier one (reads only)."""
        if self.has_steps and not (overwrite or resume):
            raise ConfigError(
                f"run directory {self.path} already holds {METRICS_FILE} from an earlier "
                "run; choose another output directory, or set overwrite=true to replace "
                "that run's outputs (your other files there are kept)"
            )

    def commit_replacement(self) -> None:
        """The new run has started: delete the earlier run that ``overwrite`` moved aside."""
        shutil.rmtree(self.path / REPLACED_DIR, ignore_errors=True)

    def restore_replaced(self) -> bool:
        """Put back an earlier run that ``overwrite`` moved aside, unless the new run has
        logged a step (then it has started and the earlier one is deleted). True if the
        earlier run was put back."""
        aside = self.path / REPLACED_DIR
        if not aside.is_dir():
            return False
        if self.has_steps:
            self.commit_replacement()
            return False
        self.remove_outputs()
        self._move_outputs(aside, self.path)
        aside.rmdir()
        return True

    @staticmethod
    def _move_outputs(source: Path, target: Path) -> None:
        """Move the :data:`RUN_OUTPUTS` in ``source`` into ``target`` (renames only)."""
        target.mkdir(exist_ok=True)
        for name in RUN_OUTPUTS:
            if (source / name).exists() or (source / name).is_symlink():
                os.replace(source / name, target / name)

    def keep_as_earlier(self) -> Path | None:
        """Move the logs of an attempt that cannot be continued (metrics, samples, config)
        into ``earlier/attempt-N/`` and return that folder (None if there were none)."""
        logs = [p for p in (self.metrics_path, self.samples_path, self.config_path) if p.exists()]
        if not logs:
            return None
        number = 1
        while (self.path / EARLIER_DIR / f"attempt-{number}").exists():
            number += 1
        target = self.path / EARLIER_DIR / f"attempt-{number}"
        target.mkdir(parents=True)
        for path in logs:
            os.replace(path, target / path.name)
        return target

    def truncate_after(self, step: int) -> None:
        """Drop the metrics and samples of steps after ``step`` (logged after the checkpoint a
        run resumes from), rewriting each file atomically; a cut-off last line goes too."""
        for path in (self.metrics_path, self.samples_path):
            if not path.exists():
                continue
            kept = [r for r in read_records(path) if int(r.get("step", 0)) <= step]
            staging = path.with_name(path.name + ".tmp")
            staging.unlink(missing_ok=True)
            append_records(staging, kept)
            staging.touch()
            staging.replace(path)

    def remove_outputs(self) -> None:
        """Delete the files and folders postrl writes here (:data:`RUN_OUTPUTS`) only."""
        for name in RUN_OUTPUTS:
            target = self.path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()

    @property
    def has_steps(self) -> bool:
        """Whether a run has logged a step here (an empty ``metrics.jsonl`` has none)."""
        return self.metrics_path.is_file() and self.metrics_path.stat().st_size > 0

    @property
    def name(self) -> str:
        """The run's name: the directory's last component."""
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def samples_path(self) -> Path:
        return self.path / SAMPLES_FILE

    @property
    def final_dir(self) -> Path:
        return self.path / FINAL_DIR

    def write_config(self, resolved: Mapping[str, Any]) -> Path:
        """Write the resolved configuration to ``config.yaml``, keys in their given order.

        Tuples become lists and paths strings, so ``dataclasses.asdict`` output is fine.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(jsonable(dict(resolved)), sort_keys=False, allow_unicode=True)
        self.config_path.write_text(text, encoding="utf-8")
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        """The configuration written by :meth:`write_config`."""
        return yaml.safe_load(self.config_path.read_text(encoding="utf-8")) or {}

    def append_samples(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append one line per row to ``samples.jsonl``, each as ``{"step": step, **row}``.

        Rows are whatever the trainer shows (prompt, completion, reward, per-function
        rewards, correct, length, finish_reason, ...); values must be JSON-serialisable
        after :func:`~postrl.telemetry.jsonl.jsonable` (NaN becomes null). Each line is
        fsync-ed like the metrics; a row that cannot be
        serialised raises before anything is written.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        append_records(self.samples_path, ({"step": int(step), **row} for row in rows))

    def read_samples(self) -> list[dict[str, Any]]:
        """Every row written by :meth:`append_samples`, in order."""
        return read_records(self.samples_path)

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every line of ``metrics.jsonl``, one dict per logged step."""
        return read_records(self.metrics_path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"


def check_out_path(path: Path) -> None:
    """ConfigError when ``path`` (a run directory to be) is a file or lies below one."""
    for candidate in (path, *path.parents):
        if candidate.exists() and not candidate.is_dir():
            raise ConfigError(f"out={str(path)!r} cannot be a run directory: {candidate} is "
                              "a file; choose another out")
        if candidate.is_dir():
            return


def make_run_directory(path: Path) -> None:
    """``mkdir -p``; ConfigError naming ``out`` when the system refuses."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"out={str(path)!r}: cannot create the run directory: "
                          f"{err.strerror or err}") from err
