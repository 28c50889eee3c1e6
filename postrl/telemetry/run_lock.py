"""One training at a time per run directory.

Two trainings writing into one ``out`` interleave their metrics and overwrite each other's
config and final model. :class:`RunLock` holds an exclusive ``flock`` on ``RUN/.postrl.lock``
for as long as a training writes there; the holder's pid is written into the file so that a
second training is refused with a message naming it. The kernel drops the lock when its holder
dies, even by SIGKILL, so no stale lock ever needs clearing by hand. Within one process, a lock
whose holder was dropped without closing (a notebook's earlier ``Trainer``) is released when the
holder is collected: :meth:`acquire` collects garbage once before it refuses this process's own
lock. Where ``fcntl`` is missing (Windows), runs are not locked.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

from postrl.errors import ConfigError
from postrl.telemetry.run_dir import make_run_directory

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None

LOCK_FILE = ".postrl.lock"


class RunLock:
    """An exclusive lock on a run directory; :meth:`acquire` creates the directory."""

    def __init__(self, directory: Path, handle) -> None:
        self.path = directory / LOCK_FILE
        self._handle = handle

    @classmethod
    def acquire(cls, directory: Path) -> RunLock:
        """Lock ``directory``, or raise ConfigError naming the process that holds it."""
        make_run_directory(directory)
        try:
            handle = open(directory / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115
        except OSError as err:
            raise ConfigError(f"out={str(directory)!r}: cannot create its lock file "
                              f"{LOCK_FILE}: {err.strerror or err}") from err
        if fcntl is not None and not _locked(handle):
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            if holder == str(os.getpid()):  # this process's: a holder no one references?
                gc.collect()
                if _locked(handle):
                    return cls._written(directory, handle)
                handle.close()
                raise ConfigError(
                    f"run directory {directory} is in use by another training in this process "
                    f"(pid {holder}): a Trainer still referenced and not closed; close it "
                    "first (trainer.close(), or a `with Trainer(cfg)` block), or choose "
                    "another out")
            handle.close()
            raise ConfigError(
                f"run directory {directory} is in use by another training (pid {holder}); "
                "wait for it to finish, or choose another out")
        return cls._written(directory, handle)

    @classmethod
    def _written(cls, directory: Path, handle) -> RunLock:
        """The lock, with this process's pid written into its file."""
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return cls(directory, handle)

    def release(self) -> None:
        """Unlock (idempotent); the file stays, holding no one's pid."""
        if self._handle is None:
            return
        self._handle.truncate(0)
        if fcntl is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None

    @property
    def held(self) -> bool:
        return self._handle is not None


def _locked(handle) -> bool:
    """Take the exclusive lock on ``handle``'s file without waiting; False if another holds it."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True
