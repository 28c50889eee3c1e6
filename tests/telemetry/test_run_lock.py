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
    with pytest.raises(ConfigError, match=rf"in use by another training \(pid {os.getpid()}\)"):
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
