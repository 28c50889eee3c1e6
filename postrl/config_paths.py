"""Paths written in a config file are relative to that file's folder.

``task: jsonl:data.jsonl``, ``rewards: [rw.py:fn]``, ``out: runs/x``, ``model: ../models/m``
and ``task_options.test_path`` mean files next to the config, wherever ``postrl`` is started
from, as paths in most tools' config files do. The same options given as ``key=value`` on the
command line stay relative to the current directory. Names that are not paths (``arithmetic``,
``tiny``, ``math_answer``, ``package.module:fn``) are left alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# the task kinds whose spec is KIND:PATH (postrl.tasks.registry.FILE_KINDS; a test keeps
# the two equal, so that config needs no import of the task loaders)
TASK_FILE_KINDS = ("gsm8k", "jsonl", "parquet")
BUILT_IN_TASKS = ("arithmetic", "countdown")


def resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of ``data`` (a config file's options) with its relative paths joined to
    ``base``, the file's folder."""
    data = dict(data)
    if isinstance(data.get("out"), str):
        data["out"] = _join(base, data["out"])
    if isinstance(data.get("task"), str):
        data["task"] = _task(base, data["task"])
    options = data.get("task_options")
    if isinstance(options, dict) and isinstance(options.get("test_path"), str):
        data["task_options"] = {**options, "test_path": _join(base, options["test_path"])}
    if isinstance(data.get("model"), str) and (base / data["model"]).exists():
        data["model"] = _join(base, data["model"])  # a hub-like id that is no folder stays
    teacher = data.get("teacher")
    if isinstance(teacher, dict) and isinstance(teacher.get("model"), str) and (
            base / teacher["model"]).exists():
        data["teacher"] = {**teacher, "model": _join(base, teacher["model"])}
    if isinstance(data.get("rewards"), list):
        data["rewards"] = [_reward(base, entry) for entry in data["rewards"]]
    return data


def _join(base: Path, path: str) -> str:
    if not path or os.path.isabs(path) or path.startswith("~"):
        return path
    return os.path.normpath(base / path)


def _task(base: Path, spec: str) -> str:
    kind, colon, path = spec.partition(":")
    if colon and kind in TASK_FILE_KINDS:
        return f"{kind}:{_join(base, path)}" if path else spec
    if spec in BUILT_IN_TASKS or colon or not (base / spec).is_dir():
        return spec
    return _join(base, spec)  # a dataset saved with save_to_disk


def _reward(base: Path, entry: Any) -> Any:
    if isinstance(entry, dict) and isinstance(entry.get("fn"), str):
        return {**entry, "fn": _reward(base, entry["fn"])}
    if not isinstance(entry, str):
        return entry
    if entry.startswith("reward_model:") and entry != "reward_model:":  # a model directory
        return "reward_model:" + _join(base, entry.partition(":")[2])
    location, colon, function = entry.rpartition(":")
    return f"{_join(base, location)}:{function}" if colon and is_file_spec(location) else entry


def is_file_spec(location: str) -> bool:
    """Whether the part before ``:fn`` of a reward spec names a file, not a module (the one
    rule ``postrl.rewards.registry`` loads by)."""
    return location.endswith(".py") or "/" in location or "\\" in location
