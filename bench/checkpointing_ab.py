"""What ``gradient_checkpointing`` costs the update and what it saves, at reasoning lengths:
each decoder layer's activations kept for the backward, or only its input and the layer
recomputed there.

    python bench/checkpointing_ab.py [--regime gsm8k-256] [--reps 2] [--only plain|checkpointed]
                                     [--micro-batch-size 16] [--model smollm2-135m-instruct]

The first step of ``bench/vs_trl.py``'s postrl run at the regime (fp32, the sampler's forward
not reused, as with the option on or off it is read the same) generates a batch; its update
then runs once untimed and ``reps`` times each way (ABBA), every run from the same weights and
optimizer state. Prints each way's median seconds and their ratio. The process keeps freed
memory (``reuse_freed_memory``), so its resident peak is the most any run needed: ``--only``
runs one way alone (its warm-up too) for that way's peak.
"""

from __future__ import annotations

import statistics

from postrl.models.policy import causal_lm

WAYS = {"plain": False, "checkpointed": True}


def main(argv: list[str] | None = None) -> None:
    from ab import (  # bench/, this script's directory
        alternating,
        from_one_state,
        on_first_batch,
        runs_text,
        update_ab,
    )

    def only_option(parser) -> None:
        parser.add_argument("--only", choices=list(WAYS), default=None,
                            help="one way alone (--reps runs), for its resident peak")

    args, trainer = update_ab(__doc__.splitlines()[0], argv, only_option)
    update, decoder = trainer.phases.update, causal_lm(trainer.lm).model.layers
    only = None if args.only is None else WAYS[args.only]
    ways = ([None, *alternating(args.reps)] if only is None
            else [None, *[only] * args.reps])

    def both_ways(batch):
        def run(checkpointed: bool | None):  # None: the untimed first run
            on = (only or False) if checkpointed is None else checkpointed
            for layer in decoder:  # the flag checkpoint_layers sets
                layer.gradient_checkpointing = on
            return update(batch)

        peaks = {}
        times, metrics = from_one_state(trainer, run, ways, peaks)
        for name, way in WAYS.items():
            if times[way]:
                print(f"{name:>12}: {runs_text(times[way], peaks[way])}")
        if only is None:
            ratio = statistics.median(times[True]) / statistics.median(times[False])
            print(f"checkpointed / plain: {ratio:.3f}")
        return metrics

    on_first_batch(trainer, args, both_ways)


if __name__ == "__main__":
    main()
