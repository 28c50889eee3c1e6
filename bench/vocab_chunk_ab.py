"""The update's pass through the LM head and the vocabulary's log-softmax, in chunks of other
sizes: ways alternated in one process on the same batch from the same weights and optimizer
state.

    python bench/vocab_chunk_ab.py [--regime gsm8k-256] [--ways 2048:0,2048:1048576,512:1048576]
                                   [--reps 2]

Each way is ``tokens:elements``: ``logprobs.HEAD_CHUNK_TOKENS`` (scored tokens per pass) and
``vocab.BLOCK_ELEMENTS`` (the largest temporary the entropy makes, 0: the whole chunk's; only
where PyTorch's operations compute the vocabulary, i.e. without the native kernels'
``vocab.c``: ``POSTRL_NATIVE_KERNELS=0``). The
first step of ``bench/vs_trl.py``'s postrl run at the regime generates a batch; its update
runs once untimed, then ``reps`` rounds of every way (the order reversed every other round).
Prints each way's median seconds and the most resident memory seen during its runs.
"""

from __future__ import annotations

import argparse

from postrl.models import logprobs, vocab


def parse_ways(text: str) -> list[tuple[int, int]]:
    """``"2048:0,512:1048576"`` as ``[(2048, 0), (512, 1048576)]``; argparse's error naming
    the way that is not a positive token count and a block size (0 or more)."""
    ways = []
    for part in text.split(","):
        tokens, _, elements = part.partition(":")
        try:
            way = int(tokens), int(elements or 0)
        except ValueError:
            way = (0, -1)
        if way[0] < 1 or way[1] < 0:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not tokens:elements (tokens at least 1, elements 0 or more)")
        ways.append(way)
    return ways


def main(argv: list[str] | None = None) -> None:
    from ab import (  # bench/, this script's directory
        add_regime_options,
        from_one_state,
        regime_trainer,
        runs_text,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_regime_options(parser)
    parser.add_argument("--ways", type=parse_ways, default="2048:0,2048:1048576,512:1048576",
                        help="comma-separated tokens:elements (elements 0: one block)")
    parser.add_argument("--reps", type=int, default=2, help="rounds of every way")
    args = parser.parse_args(argv)
    ways = args.ways
    trainer = regime_trainer(args)
    defaults = logprobs.HEAD_CHUNK_TOKENS, vocab.BLOCK_ELEMENTS
    update = trainer.phases.update

    def every_way(batch):
        def run(way):
            tokens, elements = way or defaults
            logprobs.HEAD_CHUNK_TOKENS = tokens
            vocab.BLOCK_ELEMENTS = elements or 2**62
            return update(batch)

        order = [way for r in range(args.reps) for way in (ways if r % 2 == 0 else ways[::-1])]
        peaks = {}
        times, metrics = from_one_state(trainer, run, [None, *order], peaks)
        logprobs.HEAD_CHUNK_TOKENS, vocab.BLOCK_ELEMENTS = defaults
        for way in ways:
            print(f"{way[0]:>6} tokens, blocks of {way[1] or 'all':>8}: "
                  f"{runs_text(times[way], peaks[way])}", flush=True)
        return metrics

    trainer.phases.update = every_way
    row = trainer.train_step()
    print(f"{args.regime}: responses of {row['length/mean']:.0f} tokens on average, "
          f"{int(row['rollout/tokens_generated'])} generated")


if __name__ == "__main__":
    main()
