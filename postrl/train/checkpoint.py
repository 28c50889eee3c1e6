"""Checkpoints that survive being killed anywhere.

A checkpoint is a directory ``checkpoints/step_000012/`` holding ``state.pt`` (everything the
trainer needs to continue exactly: weights, optimizer and scheduler state, RNG states, the
prompt sampler's position, counters) and ``manifest.json`` (step and SHA-256 of every file).
It is written under a temporary name, fsynced, then renamed in one atomic step; a directory
without a manifest, or whose checksums do not match, is skipped with a warning on resume.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from postrl.errors import PostRLError

PREFIX = "step_"
MANIFEST = "manifest.json"
STATE = "state.pt"
FORMAT = 1


class CheckpointError(PostRLError):
    """A checkpoint could not be written (earlier checkpoints are left intact)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _save_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save``, whose zip writer reports a failed write (a full disk) as a RuntimeError:
    an OSError saying so, with the space left on the disk."""
    try:
        torch.save(state, path)
    except RuntimeError as err:
        free = shutil.disk_usage(path.parent).free
        code = errno.ENOSPC if free < 2 * path.stat().st_size + 2**20 else errno.EIO
        raise OSError(code, f"torch.save failed ({err}) with {free / 2**30:.2f} GiB free on "
                            "the disk") from err


def save_checkpoint(root: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` under ``root``; keep the newest
    ``keep_last`` checkpoints. On any OS error (a full disk) the partial directory is removed,
    earlier checkpoints stay intact, and a CheckpointError says what happened."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    staging = root / f".tmp-{PREFIX}{step:06d}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        _save_state(state, staging / STATE)
        manifest = {"format": FORMAT, "step": step, "files": {STATE: _sha256(staging / STATE)}}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for path in (staging / STATE, staging / MANIFEST, staging):
            _fsync(path)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync(root)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        reason = str(err)
        if err.errno == errno.ENOSPC:
            free = shutil.disk_usage(root).free / 2**30
            reason = f"the disk is full ({free:.2f} GiB free once the partial save is removed)"
        raise CheckpointError(f"could not write the checkpoint of step {step} in {root}: "
                              f"{reason}; earlier checkpoints are intact") from err
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories by step, oldest first (validity not checked)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name)


def is_valid(path: Path) -> tuple[bool, str]:
    """``(valid, why not)``: a manifest, every listed file present with its checksum."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, digest in manifest["files"].items():
            if not (path / name).is_file():
                return False, f"{name} is missing"
            if _sha256(path / name) != digest:
                return False, f"{name} does not match its checksum"
        return True, ""
    except (OSError, ValueError, KeyError, TypeError) as err:
        return False, f"no readable manifest ({err})"


def latest_valid(root: Path) -> Path | None:
    """The newest valid checkpoint; invalid ones are reported with a warning and skipped."""
    for path in reversed(list_checkpoints(root)):
        valid, why = is_valid(path)
        if valid:
            return path
        warnings.warn(f"skipping checkpoint {path}: {why}", stacklevel=2)
    return None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state on the CPU, wherever it was saved (a GPU run resumes anywhere);
    ``load_state_dict`` then copies each tensor to its module's or parameter's device."""
    return torch.load(path / STATE, weights_only=False, map_location="cpu")
