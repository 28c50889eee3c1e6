"""RunLock: one training at a time per run directory, named by the holder's pid."""

import os
import signal
import subprocess
import sys
import time

import pytest

from postrl.errors import ConfigError
from postrl.telemetry.run_lock import LOCK_FILE, RunLock

HOLD = """
import sys, time
from pathlib import Path
from postrl.telemetry.run_lock import RunLock
lock = RunLock.acquire(Path(sys.argv[1]))  # held while referenced
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    lock = RunLock.acquire(tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"in use by another training in this process "
                                          rf"\(pid {os.getpid()}\)"):
        RunLock.acquire(tmp_path / "run")
    lock.release()
    lock.release()  # idempotent
    again = RunLock.acquire(tmp_path / "run")
    assert again.held
    again.release()
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""


def test_another_process_holds_it_until_it_dies_even_by_sigkill(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"\(pid {holder.pid}\)"):
            RunLock.acquire(tmp_path / "run")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel drops a dead process's flock
        try:
            RunLock.acquire(tmp_path / "run").release()
            break
        except ConfigError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_trainer_unlocks_when_closed_collected_or_leaving_its_with_block(tmp_path):
    """Two trainers made one after another in one process (a notebook, bench/roofline.py)
    share an ``out``: the first one's lock goes with it."""
    import gc

    from postrl.train.trainer import Trainer
    from tests.train.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, "grpo", "steps=1", "overwrite=true")
    first = Trainer(cfg)
    first.train_step()
    with pytest.raises(ConfigError, match="a Trainer still referenced and not closed"):
        Trainer(cfg)
    assert first.lock.held  # the refused one left the holder's lock alone
    del first  # dropped without close(): collected, and its lock with it
    with Trainer(cfg) as second:
        second.train_step()
        assert second.lock.held
    assert not second.lock.held
    second.close()  # again: nothing to do
    third = Trainer(cfg)
    third.close()
    assert not third.lock.held
    gc.collect()
