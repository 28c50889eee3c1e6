"""Median step time of every recipe on the tiny model (for before/after checks of speed work).

    python -m bench.recipe_steps [--steps 5]
    python -m bench.recipe_steps --against DIR [--rounds 3] [--steps 5]

The first form prints one line per recipe: median seconds per step (and of its training
phase) over the steps after the first.

The second compares two source trees: DIR (a checkout of the code before a change, e.g.
``git worktree add /tmp/before <commit>``) against this one. Each recipe runs in a fresh
process per tree and round, the two trees alternating and the order swapped every round,
so that the machine's drift over minutes falls on both alike; a table of the medians over
rounds follows. Even so, on a shared VM one process's step times can differ from the next's
by 10-20% with identical code (docs/performance.md): read a ratio within that band as even,
and for a change confined to a few functions, time both versions in one process on the same
batches (an A/B alternating both ways, as ``bench/kept_turns_ab.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REWARDS = ROOT / "tests" / "train" / "rewards_for_tests.py"


def recipe_names() -> list[str]:
    from postrl.recipes import PRESETS

    return list(PRESETS)


def recipe_config(name: str, steps: int):
    """Recipe ``name`` on the tiny model: 4 prompts x 8 samples, 32 new tokens, a reward on
    the responses' length, in a fresh temporary directory."""
    from postrl.config import load_config
    from postrl.recipes import PRESETS

    extra = ["recipe_options.overlong_buffer=8"] if PRESETS[name].overlong_penalty else []
    return load_config(None, [
        f"recipe={name}", "model=tiny", "task=arithmetic", f"steps={steps}",
        "prompts_per_step=4", "group_size=8", "max_new_tokens=32", "quiet=true",
        f"out={tempfile.mkdtemp()}/run", f"rewards=[{REWARDS}:length_parity]", *extra])


def time_recipe(name: str, steps: int) -> dict[str, float]:
    """Medians of ``time/step_s`` and ``time/train_s`` over ``steps`` steps but the first."""
    from postrl.train.trainer import Trainer

    trainer = Trainer(recipe_config(name, steps))
    metrics = [trainer.train_step() for _ in range(steps)][1:]
    return {key: statistics.median(m[f"time/{key}_s"] for m in metrics)
            for key in ("step", "train")}


def time_in_tree(tree: Path, name: str, steps: int) -> dict[str, float]:
    """:func:`time_recipe` in a fresh process that imports postrl from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, __file__, "--one", name, "--steps", str(steps), "--tree", str(tree)],
        env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"recipe {name} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(before: Path, rounds: int, steps: int) -> None:
    trees = {"before": before, "after": ROOT}
    print(f"before: {before}\nafter:  {ROOT}\n{rounds} rounds of {steps} steps, medians\n")
    print(f"{'recipe':<24}{'step before':>12}{'step after':>12}{'ratio':>7}"
          f"{'train before':>14}{'train after':>13}{'ratio':>7}", flush=True)
    for name in recipe_names():
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for r in range(rounds):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                runs[side].append(time_in_tree(trees[side], name, steps))
        med = {side: {key: statistics.median(run[key] for run in runs[side])
                      for key in ("step", "train")} for side in runs}
        b, a = med["before"], med["after"]
        print(f"{name:<24}{b['step']:12.3f}{a['step']:12.3f}{a['step'] / b['step']:7.3f}"
              f"{b['train']:14.3f}{a['train']:13.3f}{a['train'] / b['train']:7.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--against", type=Path, help="the source tree to compare this one with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child of --against
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import postrl

        if not Path(postrl.__file__).resolve().is_relative_to(args.tree.resolve()):
            raise SystemExit(f"postrl came from {postrl.__file__}, not from {args.tree}")
        print(json.dumps(time_recipe(args.one, args.steps)))
    elif args.against:
        if not (args.against / "postrl" / "__init__.py").is_file():
            raise SystemExit(f"--against {args.against}: no postrl/__init__.py there")
        compare(args.against, args.rounds, args.steps)
    else:
        for name in recipe_names():
            times = time_recipe(name, args.steps)
            print(f"{name:<24}{times['step']:8.3f} s/step  (train {times['train']:.3f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
