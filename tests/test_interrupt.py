"""Ctrl-C during training: a one-line message saying what was saved and how to continue,
exit status 130, no traceback; and resume=auto does continue."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from postrl.cli import main

TINY = ["--model", "tiny", "prompts_per_step=1", "group_size=2", "max_new_tokens=4",
        "quiet=true"]


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_ctrl_c_says_what_was_saved_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-m", "postrl.cli", "train", *TINY, "--steps", "10000", "save_every=1",
         "--out", str(run)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    deadline = time.monotonic() + 300
    while len(logged_steps(run)) < 2:
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("postrl: interrupted; "), err
    assert f"steps are logged in {run / 'metrics.jsonl'}" in line
    assert "the newest checkpoint is step_" in line and "resume=auto" in line
    assert not (run / ".postrl-replaced").exists()

    done = logged_steps(run)[-1]
    assert main(["train", *TINY, "--steps", str(done + 1), "--out", str(run),
                 "save_every=1", "resume=auto"]) == 0
    assert logged_steps(run) == list(range(1, done + 2))
