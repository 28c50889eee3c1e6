"""The update reading the sampler's recorded forward against the update that multiplies, and
what recording costs the sampler; each alternated in one process on the same batches.

    python bench/recorded_forward_ab.py update [--steps 6] [--reps 2] [--compiled]
                                              [--precision fp32|bf16-master]
                                              [--regime short] [--record-share S]
    python bench/recorded_forward_ab.py sampler [--reps 8] [--precision fp32|bf16-master]

``update``: ``bench/vs_trl.py``'s postrl run at ``--regime`` (SmolLM2, 4 prompts x 8, 64 new
tokens in ``short``; fp32 unless ``--precision bf16-master``, whose record is bf16), the record
allowed ``--record-share`` of the machine's memory (default: the backend's share).
Each step's update runs both ways ``reps`` times from the same weights and optimizer state
(ABBA order; the process's first update warms up and is left out), and one line per step
gives the tokens and the medians. ``--compiled``: the update that multiplies runs postrl's
layers compiled, as ``torch_compile=true`` did before it kept the record (the compile falls in
an untimed first run). ``sampler``: ``generate`` on that run's first prompts with and without
recording, alternated, medians over the calls but the first two.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from postrl.accel.recorded import parameter_versions


def update(steps: int, reps: int, compiled: bool = False, precision: str = "fp32",
           regime=None, record_share: float | None = None) -> None:
    from ab import alternating, from_one_state  # bench/, this script's directory
    from vs_trl import postrl_config

    from postrl.accel import decoding
    from postrl.train.trainer import Trainer

    if record_share is not None:
        decoding.RECORD_MEMORY_SHARE = record_share
    trainer = Trainer(postrl_config(steps, seed=0, precision=precision,
                                    **({"regime": regime} if regime else {})))
    assert trainer.engine.record_forward
    original = trainer.phases.update
    totals: dict[bool, list[float]] = {True: [], False: []}
    peaks = {True: 0.0, False: 0.0}
    label = "compiled, mult. s" if compiled else "multiplies s"
    print(f"{'step':>4}{'tokens':>8}{label:>19}{'reads record s':>16}{'ratio':>7}")

    def both_ways(batch):
        assert batch.kept_rows is not None, "the sampler recorded nothing"

        def run(read):
            # the same weights as recorded: the record may be read again
            batch.kept_rows.record.versions = parameter_versions(trainer.scoring_lm)
            # the untimed warm-up takes the way that compiles, if any
            multiplies = read is False or (read is None and compiled)
            trainer.cfg.torch_compile = compiled and multiplies
            return original(dataclasses.replace(batch, kept_rows=None) if multiplies else batch)

        # the process's first update warms up (allocations, kernels)
        ways = alternating(reps) if totals[True] else [None, *alternating(reps)]
        times, metrics = from_one_state(trainer, run, ways, peaks)
        plain, recorded = (statistics.median(times[way]) for way in (False, True))
        totals[False].append(plain)
        totals[True].append(recorded)
        print(f"{trainer.step:>4}{int(batch.lengths.sum()):>8}{plain:>19.3f}{recorded:>16.3f}"
              f"{recorded / plain:>7.3f}", flush=True)
        return metrics  # the last run's: both ways make the same step to float32 roundoff

    trainer.phases.update = both_ways
    for _ in range(steps):
        trainer.train_step()
    print(f"sum of step medians: multiplies {sum(totals[False]):.2f} s, "
          f"reads the record {sum(totals[True]):.2f} s; resident peaks {peaks[False]:.0f} and "
          f"{peaks[True]:.0f} MB")


def sampler(reps: int, precision: str = "fp32") -> None:
    from ab import first_prompt_ids  # bench/, this script's directory
    from vs_trl import postrl_config

    from postrl.train.trainer import Trainer

    trainer = Trainer(postrl_config(1, seed=0, precision=precision))
    engine = trainer.engine
    prompts = first_prompt_ids(trainer)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(reps):
        for record in ((True, False) if i % 2 else (False, True)):
            engine.record_forward = record
            start = time.perf_counter()
            out = engine.generate(prompts, 8, trainer.sampling, seed=i)
            times[record].append(time.perf_counter() - start)
            assert (out.kept_rows is not None) is record
            del out
    without, recording = (statistics.median(times[way][2:]) for way in (False, True))
    print(f"generate, medians of {reps - 2} calls: without recording {without:.3f} s, "
          f"recording {recording:.3f} s ({recording / without:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("update", "sampler"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=None,
                        help="runs of each way per step (update: 2) or calls (sampler: 8)")
    parser.add_argument("--compiled", action="store_true",
                        help="update: the way that multiplies runs compiled layers")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-master"))
    parser.add_argument("--regime", default="short", help="update: bench/regimes.py's regime")
    parser.add_argument("--gsm8k", default=None, help="GSM8K's train.jsonl (regimes' default)")
    parser.add_argument("--record-share", type=float, default=None,
                        help="update: the most of the memory a record may take")
    args = parser.parse_args()
    if args.what == "update":
        from regimes import GSM8K, parse_regimes  # bench/, this script's directory

        regime = parse_regimes(args.regime, Path(args.gsm8k or GSM8K))[0]
        update(args.steps, args.reps or 2, args.compiled, args.precision, regime,
               args.record_share)
    else:
        sampler(args.reps or 8, args.precision)


if __name__ == "__main__":
    main()
