"""Ctrl-C (SIGINT) and a scheduler's SIGTERM during training: a one-line message saying
what was saved and how to continue, exit status 128 + the signal, no traceback; and
resume=auto does continue."""

import json
import os
import signal
import subprocess
import sys
import threading
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


def sigterm_after_two_steps(run: Path) -> threading.Thread:
    """A started thread that sends this process SIGTERM once ``run`` has logged two steps."""
    def terminate():
        deadline = time.monotonic() + 300
        while len(logged_steps(run)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate, daemon=True)
    killer.start()
    return killer


def test_ctrl_c_says_what_was_saved_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-m", "postrl.cli", "train", *TINY, "--steps", "10000", "save_every=1",
         "--out", str(run)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        # a shell's background jobs ignore SIGINT, and Python then never raises
        # KeyboardInterrupt: give the child the default disposition, as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while len(logged_steps(run)) < 2:
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("postrl: interrupted (SIGINT); "), err
    assert f"steps are logged in {run / 'metrics.jsonl'}" in line
    assert "the newest checkpoint is step_" in line and "resume=auto" in line
    assert not (run / ".postrl-replaced").exists()

    done = logged_steps(run)[-1]
    assert main(["train", *TINY, "--steps", str(done + 1), "--out", str(run),
                 "save_every=1", "resume=auto"]) == 0
    assert logged_steps(run) == list(range(1, done + 2))


def test_sigterm_stops_like_ctrl_c(tmp_path, capsys):
    """In this process: a thread sends SIGTERM once two steps are logged."""
    run = tmp_path / "run"

    before = signal.getsignal(signal.SIGTERM)
    killer = sigterm_after_two_steps(run)
    code = main(["train", *TINY, "--steps", "10000", "--out", str(run)])
    killer.join()
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "postrl: interrupted (SIGTERM); " in err and "Traceback" not in err
    assert "no checkpoint was saved (save_every=0 saves none)" in err
    assert signal.getsignal(signal.SIGTERM) is before  # the CLI put the handler back


def test_a_keyboard_interrupt_raised_by_other_code_counts_as_ctrl_c(tmp_path, capsys,
                                                                     monkeypatch):
    from postrl.train.trainer import Trainer

    def interrupted(self):
        raise KeyboardInterrupt("raised by a library, with its own message")

    monkeypatch.setattr(Trainer, "train", interrupted)
    code = main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 130 and err.startswith("postrl: interrupted (SIGINT); "), err
    assert "Traceback" not in err


def test_sigterm_stops_a_comparison_which_resume_continues(tmp_path, capsys):
    """Any command stops on SIGTERM as train does; compare's line says how to continue."""
    out = tmp_path / "cmp"
    run = out / "grpo" / "s0"
    argv = ["compare", "grpo", "--seeds", "1", "--out", str(out), "model=tiny", *TINY[2:],
            "save_every=1"]

    before = signal.getsignal(signal.SIGTERM)
    killer = sigterm_after_two_steps(run)
    code = main([*argv, "steps=10000"])
    killer.join()
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith(
        "postrl: compare interrupted (SIGTERM); finished runs are kept; the same command "
        "with --resume"), err
    assert "Traceback" not in err and signal.getsignal(signal.SIGTERM) is before

    done = logged_steps(run)[-1]
    assert main([*argv, f"steps={done + 1}", "--resume"]) == 0
    assert logged_steps(run) == list(range(1, done + 2))
    assert (run / "final" / "config.json").is_file()
