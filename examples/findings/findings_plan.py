"""The experiments behind docs/findings.md, and the driver that runs them (``make findings``).

Each experiment is ONE ``postrl compare`` or ``postrl ladder`` command on one base config of
this folder, at one generated-token budget shared by all its runs, with three seeds::

    python examples/findings/findings_plan.py --out runs/findings            # all, ~70 min
    python examples/findings/findings_plan.py --out runs/findings --only length --dry-run

To redo one experiment, remove its directory (compare refuses run directories that hold runs)
and run it with ``--only NAME``; then rerun write_report.py.

Every experiment's output goes to ``OUT/<name>/`` (the runs, ``comparison.json`` and the
usual report); the driver adds ``OUT/<name>/findings.json`` with the exact command and its
wall-clock seconds, which write_report.py puts into the document.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from findings_data import RUN_RECORD


@dataclass(frozen=True)
class Experiment:
    """One comparison: ``postrl <command> <recipes> --config <config> ...``."""

    name: str  # its directory under OUT and its key in notes.md placeholders
    title: str
    command: str  # "compare" or "ladder"
    recipes: tuple[str, ...]  # compare: the recipes; ladder: FROM and TO
    config: str  # the base config, relative to the repository root
    token_budget: int
    seeds: int = 3

    def argv(self, out_root: Path | str, overrides: Sequence[str] = ()) -> list[str]:
        """The postrl arguments, with ``--out OUT/<name>`` and ``overrides`` (key=value options
        shared by every run, for trials)."""
        return [self.command, *self.recipes, "--config", self.config, "--seeds", str(self.seeds),
                "--token-budget", str(self.token_budget), "--out", f"{out_root}/{self.name}",
                *overrides]


# Budgets sized so that all 30 runs take ~70 min on a 2-core CPU at the measured ~38 ms per
# generated token (the Makefile's `findings` target); runs take ~7-11 steps of 2 x 8 samples.
EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("length", "Response length: GRPO vs Dr. GRPO", "compare", ("grpo", "dr_grpo"),
               "examples/findings/length.yaml", token_budget=4500),
    # clip-higher is applied from the start: with one update per batch it is exactly inert
    # (every ratio is 1), so its rung would repeat the previous one (docs/comparing.md §4)
    Experiment("ladder", "From GRPO to DAPO, one component at a time", "ladder",
               ("grpo:clip_high=0.28", "dapo"), "examples/findings/ladder.yaml",
               token_budget=2600),
    Experiment("offpolicy", "Off-policy updates: GRPO vs GSPO vs DHPO", "compare",
               ("grpo", "gspo", "dhpo"), "examples/findings/offpolicy.yaml", token_budget=2800),
)
BY_NAME = {e.name: e for e in EXPERIMENTS}


def select(names: list[str] | None) -> list[Experiment]:
    """The experiments named (all when none); SystemExit naming an unknown one."""
    if not names:
        return list(EXPERIMENTS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"findings_plan: unknown experiment(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names]


def launch(argv: list[str]) -> int:
    """``postrl ARGV`` in a fresh process (each experiment starts from a clean interpreter)."""
    return subprocess.call([sys.executable, "-m", "postrl.cli", *argv])


def run_one(experiment: Experiment, out_root: Path, dry_run: bool = False,
            overrides: Sequence[str] = ()) -> float:
    """Run one experiment's postrl command; record command and wall time; return seconds."""
    argv = experiment.argv(out_root, overrides) + (["--dry-run"] if dry_run else [])
    print("$ postrl " + shlex.join(argv), flush=True)
    started = time.perf_counter()
    code = launch(argv)
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"findings_plan: experiment {experiment.name} failed (exit {code})")
    if not dry_run:
        record = {"experiment": experiment.name, "command": "postrl " + shlex.join(argv),
                  "wall_seconds": round(seconds, 1)}
        path = out_root / experiment.name / RUN_RECORD
        path.write_text(json.dumps(record, indent=2) + "\n")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/findings"),
                        help="root of the experiments' directories (default runs/findings)")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run only this experiment (repeatable): " + ", ".join(BY_NAME))
    parser.add_argument("--dry-run", action="store_true",
                        help="check each comparison's fairness and print its plan; train nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="options shared by every run of every experiment (e.g. threads=2)")
    args = parser.parse_args(argv)
    total = 0.0
    for experiment in select(args.only):
        total += run_one(experiment, args.out, args.dry_run, args.overrides)
    print(f"findings: {total / 60:.1f} min in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
