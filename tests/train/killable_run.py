"""Run training in a child process and SIGKILL it at a chosen point (for resume tests).

    python killable_run.py WHEN STEP key=value ...

WHEN is ``after_log`` (metrics of STEP written, its checkpoint not yet), ``after_save`` (the
checkpoint of STEP complete) or ``in_save`` (while the checkpoint of STEP is being written).
"""

import os
import signal
import sys

import pytest

from postrl.config import load_config
from postrl.train import checkpoint, trainer


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    when, step, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    save = trainer.maybe_save
    fsync = checkpoint._fsync

    def patched_save(objects, state, cfg, run, final=False):
        if when == "after_log" and state.step == step:
            die()
        save(objects, state, cfg, run, final)
        if when == "after_save" and state.step == step:
            die()

    def patched_fsync(path):
        if when == "in_save" and f"step_{step:06d}" in str(path):
            die()  # the state file is written, the manifest not yet fsynced or renamed
        fsync(path)

    with pytest.MonkeyPatch.context() as patch:  # for this run only, as in a test
        patch.setattr(trainer, "maybe_save", patched_save)
        patch.setattr(checkpoint, "_fsync", patched_fsync)
        trainer.Trainer(load_config(None, overrides)).train()


if __name__ == "__main__":
    main()
