"""Episodes whose later turns keep their cache, against later turns prefilled whole, alternated
in one process on the same step's episodes: the sampler's seeds depend on the step alone, so
both ways draw the same tokens up to float rounding (keys computed one token at a time or in
a prefill, summed in another order), which can flip a sampled token and change an episode
from there; the script says how many episodes agree, and their tokens each way.

    python -m bench.kept_turns_ab [--config examples/calculator.yaml] [--reps 2] [KEY=VALUE ...]

Prints, for each way, the tokens fed through a prefill (``rollout/prefill_tokens``) and the
seconds of generation (``time/generate_s``, the environments' steps included) of one step's
draw: ``make demo-tools``' configuration by default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def alternating(reps: int) -> list[bool]:
    """``reps`` pairs of the two ways, the order swapped every pair (ABBA...): drift over the
    run falls on both alike."""
    return [way for i in range(reps) for way in ((True, False) if i % 2 else (False, True))]


class WholeTurns:
    """The engine without ``keeping_turns``: every turn prefills its whole context."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def draw_both_ways(trainer, reps: int) -> dict[str, dict[str, list[float]]]:
    """Step 0's draw ``reps`` times each way (ABBA), from the same prompts: each way's prefill
    tokens and generation seconds per draw."""
    results: dict[str, dict[str, list[float]]] = {}
    for keep in [None, *alternating(reps)]:  # None: a warm-up, not recorded
        trainer.sampler.restore(0, 0)
        engine = trainer.engine if keep is not False else WholeTurns(trainer.engine)
        drawn = trainer.draw(0, engine)
        if keep is None:
            continue
        way = results.setdefault("kept" if keep else "whole",
                                 {"prefill": [], "seconds": [], "texts": []})
        generated = drawn.collected.generated
        way["texts"].append([t for g in generated for t in g.rollouts.texts])
        way["tokens"] = sum(g.tokens for g in generated)
        way["turns"] = sum(sum(g.rollouts.episodes.turns) for g in generated)
        way["prefill"].append(sum(int(g.rollouts.prefill_lengths.sum()) for g in generated))
        way["seconds"].append(drawn.timings["generate"])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "examples" / "calculator.yaml"))
    parser.add_argument("--reps", type=int, default=2, help="ABBA pairs")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE options for the config")
    args = parser.parse_args(argv)
    from postrl.config import load_config
    from postrl.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="postrl-kept-turns-") as out:
        cfg = load_config(args.config, [f"out={out}", *args.overrides])
        trainer = Trainer(cfg)
        results = draw_both_ways(trainer, args.reps)
    for way in ("kept", "whole"):
        r = results[way]
        print(f"{way:>5} turns: prefill {statistics.median(r['prefill']):,.0f} tokens, "
              f"generation {statistics.median(r['seconds']):.2f} s "
              f"(runs: {', '.join(f'{s:.2f}' for s in r['seconds'])}); "
              f"{r['turns']} turns, {r['tokens']:,} generated tokens")
    same = sum(a == b for a, b in zip(results["kept"]["texts"][0], results["whole"]["texts"][0],
                                      strict=True))
    print(f"episodes alike both ways: {same} of {len(results['kept']['texts'][0])}")
    kept, whole = (statistics.median(results[w]["seconds"]) for w in ("kept", "whole"))
    print(f"generation, kept / whole: {kept / whole:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
