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

import statistics

from postrl.models import ops


def main(argv: list[str] | None = None) -> None:
    from ab import (  # bench/, this script's directory
        alternating,
        from_one_state,
        on_first_batch,
        runs_text,
        update_ab,
    )

    args, trainer = update_ab(__doc__.splitlines()[0], argv)
    default, update = ops.FUSED_ATTENTION_SCORES, trainer.phases.update

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

    on_first_batch(trainer, args, both_ways)


if __name__ == "__main__":
    main()
