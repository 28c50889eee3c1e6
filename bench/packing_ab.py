"""What padding costs the update at reasoning lengths: responses packed (postrl's default)
against each padded to its micro-batch's longest, alternated in one process on the same batch
from the same weights and optimizer state.

    python bench/packing_ab.py [--regime gsm8k-256] [--reps 2] [--micro-batch-size 16]
                               [--model smollm2-135m-instruct]

The first step of ``bench/vs_trl.py``'s postrl run at the regime (fp32, the sampler's forward
not reused: it is read on the packed path only) generates a batch; its update then runs once
untimed and ``reps`` times each way (ABBA): the responses of a micro-batch's prompts packed
into rows as wide as the longest (``postrl/models/packing.py``), or every response padded to
the longest, each row after its prompt's keys and values (``pack_responses`` made to decline,
as it does where packing would save no row). The prompts run once per micro-batch either way.
Prints each way's median seconds, the most resident memory seen during its runs (sampled
every 50 ms), and the response tokens each way puts through the layers.
"""

from __future__ import annotations

import statistics

from postrl.models import logprobs


def main(argv: list[str] | None = None) -> None:
    from ab import (  # bench/, this script's directory
        alternating,
        from_one_state,
        on_first_batch,
        runs_text,
        update_ab,
    )

    args, trainer = update_ab(__doc__.splitlines()[0], argv)
    pack, update = logprobs.pack_responses, trainer.phases.update
    columns = {True: 0, False: 0}  # response columns through the layers in one update

    def both_ways(batch):
        def run(packed: bool | None):  # None: the untimed first run, packed
            def counted(response_ids, *rest):
                packing = pack(response_ids, *rest)
                padded = packing is None or packed is False
                shape = response_ids.shape if padded else packing.input_ids.shape
                if packed is not None:
                    columns[packed] += shape[0] * shape[1]
                return None if padded else packing

            if packed is not None:
                columns[packed] = 0
            logprobs.pack_responses = counted
            return update(batch)

        peaks = {}
        times, metrics = from_one_state(trainer, run, [None, *alternating(args.reps)], peaks)
        logprobs.pack_responses = pack
        for packed, name in ((False, "padded"), (True, "packed")):
            print(f"{name:>7}: {runs_text(times[packed], peaks[packed])}; "
                  f"{columns[packed]:,} response columns")
        print(f"packed / padded: "
              f"{statistics.median(times[True]) / statistics.median(times[False]):.3f}")
        return metrics

    on_first_batch(trainer, args, both_ways)


if __name__ == "__main__":
    main()
