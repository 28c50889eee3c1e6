"""The lean sampler in float32 with postrl's own kernels (``postrl/accel/csrc/gemm.c`` and
``decode.c``: linears, RMSNorm, decode attention) against PyTorch's and oneDNN's (what it
ran before), alternated in one process.

    python bench/native_kernels_ab.py [--reps 8]

``bench/vs_trl.py``'s first prompts (SmolLM2, fp32, 4 prompts x 8, 64 new tokens): one
``generate`` samples their responses; then, each way ``reps`` times (ABBA order), the
weights are packed for sampling (as every ``generate`` does after an update) and the lean
decoder is fed those same tokens, dropping finished rows as the engine does
(``decode_attention_ab.decode``). Medians over the runs but the first two, of the packing, of
the prefill and decode, and of their sum. The same tokens each way, since the two round
differently and sampling would soon draw other ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from postrl.accel import lean_weights, library, native


def main() -> None:
    from ab import alternating, first_prompt_ids  # bench/, this script's directory
    from decode_attention_ab import decode
    from vs_trl import GROUP, MAX_NEW, postrl_config

    from postrl.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8, help="runs of each way")
    args = parser.parse_args()
    if native.native_kernels() is None:
        raise SystemExit(f"the native kernels are not available: {native.unavailable_reason()}")
    trainer = Trainer(postrl_config(1, seed=0))
    engine = trainer.engine
    prompts = first_prompt_ids(trainer)
    rollouts = engine.generate(prompts, GROUP, trainer.sampling, seed=0)
    times = {way: {"pack": [], "decode": [], "both": []} for way in (False, True)}
    for way in alternating(args.reps):
        os.environ[library.SWITCH] = "1" if way else "0"
        start = time.perf_counter()
        weights = lean_weights.LeanWeights.of(trainer.lm, torch.float32, len(rollouts.lengths))
        packed = time.perf_counter()
        decode(weights, prompts, GROUP, MAX_NEW, rollouts.response_ids, rollouts.lengths,
               engine.pad_id)
        end = time.perf_counter()
        for part, seconds in (("pack", packed - start), ("decode", end - packed),
                              ("both", end - start)):
            times[way][part].append(seconds)
        del weights
    print(f"{int(rollouts.lengths.sum())} tokens of 32 responses (longest "
          f"{int(rollouts.lengths.max())}) after {max(len(p) for p in prompts)} prompt tokens; "
          f"medians of {args.reps - 2} runs each way:")
    for part in ("pack", "decode", "both"):
        before, after = (statistics.median(times[way][part][2:]) for way in (False, True))
        print(f"  {part:<7} PyTorch/oneDNN {before:.3f} s, native {after:.3f} s "
              f"({after / before:.3f})")


if __name__ == "__main__":
    main()
