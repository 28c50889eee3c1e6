"""The sampler's draw (softmax, cumulative sum and search over the vocabulary) by postrl's
native kernel (``postrl/rollout/sample.c``) against PyTorch's, alternated in one process.

    python bench/native_sampling_ab.py [--reps 8] [--precision fp32|bf16-master]

``bench/vs_trl.py``'s first prompts (SmolLM2, 4 prompts x 8, 64 new tokens): ``generate``
``reps`` times each way (ABBA order) with the same seed, so both ways draw the same tokens;
medians over the calls but the first two, and the tokens each way drew (equal unless a
uniform fell within float rounding of a boundary). Everything else (the linears, the decode
step's glue) runs as the trainer runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from postrl.rollout import sampling


def main() -> None:
    from ab import alternating, first_prompt_ids  # bench/, this script's directory
    from vs_trl import GROUP, postrl_config

    from postrl.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8, help="calls each way")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-master"))
    args = parser.parse_args()
    kernels = sampling.native_kernels
    if kernels() is None:
        raise SystemExit("the native kernels are not available here")
    trainer = Trainer(postrl_config(1, seed=0, precision=args.precision))
    engine = trainer.engine
    prompts = first_prompt_ids(trainer)
    times: dict[bool, list[float]] = {True: [], False: []}
    drawn: dict[bool, object] = {}
    for native in alternating(args.reps):
        sampling.native_kernels = kernels if native else (lambda: None)
        start = time.perf_counter()
        rollouts = engine.generate(prompts, GROUP, trainer.sampling, seed=0)
        times[native].append(time.perf_counter() - start)
        drawn[native] = rollouts.response_ids
        del rollouts  # its record's memory goes to the next call
    sampling.native_kernels = kernels
    same = drawn[True].shape == drawn[False].shape and bool((drawn[True] == drawn[False]).all())
    before, after = (statistics.median(times[way][2:]) for way in (False, True))
    print(f"generate ({args.precision}), medians of {args.reps - 2} calls each way: PyTorch's "
          f"draw {before:.3f} s, native {after:.3f} s ({after / before:.3f}); "
          f"{'the same' if same else 'different'} tokens")


if __name__ == "__main__":
    main()
