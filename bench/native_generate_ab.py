"""A piece of the sampler by postrl's native kernels against without it, alternated in one
process, over whole ``generate`` calls.

    python bench/native_generate_ab.py --part draw|layers|between|linears [--reps 8]
                                       [--precision fp32|bf16-master]

``draw``: the draw from the logits (softmax, cumulative sum and search over the vocabulary)
by ``postrl/accel/csrc/sample.c`` against PyTorch's. ``layers``: a decode step's layers in one
call (``postrl/accel/csrc/step.c``) against the Python loop over the same kernels (float32, or
bf16 on a CPU with AMX tiles or AVX512-BF16). ``between``: a bf16 sampler's work between its linears
(RMSNorm, the residual adds, SiLU · up, the rotation with the cache's new column, attention)
by ``postrl/accel/csrc/decode.c`` against PyTorch's operations, the linears the same either way
(bf16-master only; off, the step runs as the Python loop). ``linears``: a bf16 sampler's
linears by postrl's (``postrl/accel/csrc/dpbf16.c``: on AMX tiles, else by VDPBF16PS) against
oneDNN's (bf16-master, on a CPU with AMX tiles or AVX512-BF16).
``bench/vs_trl.py``'s first prompts (SmolLM2, 4 prompts x 8, 64 new tokens): ``generate``
``reps`` times each way (ABBA order) with the same seed, recording as the trainer does, so
both ways draw the same tokens; medians over the calls but the first two, and whether the two
ways drew the same tokens (they may not where a uniform falls within float rounding of a
boundary). Everything else runs as the trainer runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from postrl import accel
from postrl.accel import lean_weights, native


def switches(part: str):
    """``switch(on)`` for ``part``: the native way on or off."""
    if part == "draw":
        draws = accel.AccelBackend.draws

        def draw(on: bool) -> None:
            accel.AccelBackend.draws = draws if on else (lambda self, logits: False)
        return draw
    if part == "linears":
        kernels = native.native_kernels()
        own = kernels.bf16_linears

        def linears(on: bool) -> None:
            kernels.bf16_linears = own if on else False
        return linears
    weights_of = lean_weights.LeanWeights.of
    if part == "between":
        def without_between(model, dtype, rows):
            weights = weights_of(model, dtype, rows)
            return (weights if dtype != torch.bfloat16
                    else dataclasses.replace(weights, native=None, pointers=None))

        def between(on: bool) -> None:
            lean_weights.LeanWeights.of = weights_of if on else without_between
        return between

    def layers(on: bool) -> None:
        lean_weights.LeanWeights.of = weights_of if on else (
            lambda model, dtype, rows: dataclasses.replace(weights_of(model, dtype, rows),
                                                           pointers=None))
    return layers


def main() -> None:
    from ab import alternating, first_prompt_ids  # bench/, this script's directory
    from vs_trl import GROUP, postrl_config

    from postrl.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=("draw", "layers", "between", "linears"))
    parser.add_argument("--reps", type=int, default=8, help="calls each way")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-master"))
    args = parser.parse_args()
    if native.native_kernels() is None:
        raise SystemExit(f"the native kernels are not available: {native.unavailable_reason()}")
    own_bf16 = native.native_kernels().bf16_linears
    if args.part == "layers" and args.precision != "fp32" and not own_bf16:
        raise SystemExit("--part layers: a bf16 decode step runs in one call with postrl's "
                         "bf16 linears only (AMX tiles or AVX512-BF16)")
    if args.part in ("between", "linears") and args.precision != "bf16-master":
        raise SystemExit(f"--part {args.part}: a bf16 sampler's kernels; use bf16-master")
    if args.part == "linears" and not own_bf16:
        raise SystemExit("--part linears: this CPU has neither AMX tiles nor AVX512-BF16")
    trainer = Trainer(postrl_config(1, seed=0, precision=args.precision))
    engine = trainer.engine
    prompts = first_prompt_ids(trainer)
    switch = switches(args.part)
    times: dict[bool, list[float]] = {True: [], False: []}
    drawn: dict[bool, object] = {}
    for on in alternating(args.reps):
        switch(on)
        start = time.perf_counter()
        rollouts = engine.generate(prompts, GROUP, trainer.sampling, seed=0)
        times[on].append(time.perf_counter() - start)
        drawn[on] = rollouts.response_ids
        del rollouts  # its record's memory goes to the next call
    switch(True)
    same = drawn[True].shape == drawn[False].shape and bool((drawn[True] == drawn[False]).all())
    before, after = (statistics.median(times[way][2:]) for way in (False, True))
    print(f"generate ({args.precision}), {args.part}, medians of {args.reps - 2} calls each "
          f"way: without {before:.3f} s, native {after:.3f} s ({after / before:.3f}); "
          f"{'the same' if same else 'different'} tokens")


if __name__ == "__main__":
    main()
