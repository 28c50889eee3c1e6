"""The update's attention at reasoning lengths: matmul-softmax against SDPA, alternated in one
process on the same batch from the same weights and optimizer state.

    python bench/attention_ab.py [--regime gsm8k-256] [--reps 2] [--micro-batch-size 16]
                                 [--model smollm2-135m-instruct]

The first step of ``bench/vs_trl.py``'s postrl run at the regime (fp32, the sampler's forward
not reused, so that both ways run the same forward) generates a batch; its update then runs
once untimed and ``reps`` times each way (ABBA): SDPA from ``ops.FUSED_ATTENTION_SCORES``
scores per row and head on (postrl's default), or matmul-softmax at every length. Prints each
way's median seconds and the most resident memory seen during its runs (sampled every 50 ms).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from postrl.models import ops


def main(argv: list[str] | None = None) -> None:
    from ab import alternating, from_one_state, runs_text  # bench/, this script's directory
    from regimes import GSM8K, REGIMES, parse_regimes
    from vs_trl import postrl_config

    from postrl.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", default="gsm8k-256", choices=list(REGIMES))
    parser.add_argument("--reps", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--gsm8k", default=str(GSM8K))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    regime = parse_regimes(args.regime, Path(args.gsm8k))[0]
    config = postrl_config(1, seed=0, micro_batch_size=args.micro_batch_size, regime=regime)
    config.reuse_sampler_forward, config.model = False, args.model
    trainer = Trainer(config)
    default, update = ops.FUSED_ATTENTION_SCORES, trainer._update

    def both_ways(batch):
        def run(sdpa: bool | None):
            ops.FUSED_ATTENTION_SCORES = default if sdpa in (True, None) else float("inf")
            return update(batch)

        peaks = {}
        times, metrics = from_one_state(trainer, run, [None, *alternating(args.reps)], peaks)
        ops.FUSED_ATTENTION_SCORES = default
        for sdpa, name in ((False, "matmul-softmax"), (True, "SDPA")):
            print(f"{name:>15}: {runs_text(times[sdpa], peaks[sdpa])}")
        print(f"SDPA / matmul-softmax: "
              f"{statistics.median(times[True]) / statistics.median(times[False]):.3f}")
        return metrics

    trainer._update = both_ways
    row = trainer.train_step()
    print(f"{args.regime}: responses of {row['length/mean']:.0f} tokens on average, the "
          f"longest {row['length/max']:.0f}; {args.micro_batch_size} rows per micro-batch")


if __name__ == "__main__":
    main()
