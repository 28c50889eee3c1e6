"""bench/staleness.py: every arm trains in a child of its own with the staleness and sampler
it names, and the table reads the runs' own metrics."""

import json
import subprocess
import sys
from pathlib import Path

from bench import staleness

REPO = Path(__file__).resolve().parents[1]


def test_each_arm_runs_with_its_staleness_and_sampler(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {a}?",
                                        "answer": f"#### {2 * a}"}) + "\n" for a in range(200)))
    out = tmp_path / "staleness.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench.staleness", "--model", "tiny",
                           "--steps", "6", "--max-new-tokens", "4", "--gsm8k", str(data),
                           "--out", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["max_staleness"], r["overlap_sampling"], r["threads"]) for r in results] == (
        staleness.ARMS)
    assert [r["steps"] for r in results] == [5, 4, 4, 4, 1, 1]  # not the last k steps
    assert all(r["tokens_per_s"] > 0 for r in results)
    synchronous, overlapped = results[0], results[2]
    assert synchronous["async/trainer_idle_s"] == 0  # no async/* without staleness
    assert overlapped["time/step_s"] > 0
    assert proc.stdout.splitlines()[-1].startswith("| 4 | thread | all |")
