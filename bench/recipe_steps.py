"""Median step time of every recipe on the tiny model (for before/after checks of speed work).

    python bench/recipe_steps.py [--steps 5]

Prints one line per recipe: median seconds per step over the steps after the first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from postrl.config import load_config
from postrl.recipes import PRESETS
from postrl.train.trainer import Trainer

REWARDS = Path(__file__).resolve().parents[1] / "tests" / "train" / "rewards_for_tests.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    for name, recipe in PRESETS.items():
        extra = ["recipe_options.overlong_buffer=8"] if recipe.overlong_penalty else []
        cfg = load_config(None, [
            f"recipe={name}", "model=tiny", "task=arithmetic", f"steps={args.steps}",
            "prompts_per_step=4", "group_size=8", "max_new_tokens=32", "quiet=true",
            f"out={tempfile.mkdtemp()}/run", f"rewards=[{REWARDS}:length_parity]", *extra])
        trainer = Trainer(cfg)
        times = [trainer.train_step()["time/step_s"] for _ in range(args.steps)][1:]
        print(f"{name:<24}{statistics.median(times):8.3f} s/step", flush=True)


if __name__ == "__main__":
    main()
