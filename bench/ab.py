"""Two ways of one training step, timed in one process from the same state, the trainer of a
regime's first batch, and the prompts a trainer samples first (for the A/B scripts beside
this one: ``prompt_pass_ab.py``, ``unscored_rows_ab.py``, ``recorded_forward_ab.py``,
``decode_attention_ab.py``, ``native_kernels_ab.py``, ``native_generate_ab.py``,
``attention_ab.py``, ``packing_ab.py``, ``checkpointing_ab.py``, ``vocab_chunk_ab.py``).
Whole
processes differ by 10-20% on a shared VM; runs of the same batch from the same weights and
optimizer state, alternated, do not."""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def alternating(reps: int, flip: bool = False) -> list[bool]:
    """``reps`` pairs of ways, the order swapped every pair (ABBA...); ``flip`` starts with
    True instead of False."""
    return [way != flip for i in range(reps) for way in ((True, False) if i % 2 else (False, True))]


def from_one_state(trainer, run: Callable[[bool | None], Any], ways: list[Any],
                   peaks: dict[Any, float] | None = None) -> tuple[dict[Any, list[float]], Any]:
    """Seconds of ``run(way)`` for each of ``ways`` (True and False, or any other labels),
    every run from the weights and optimizer state ``trainer`` has now (a way of None runs
    untimed: a warm-up); and the last run's result, whose state the trainer keeps. With
    ``peaks``, each timed way's most resident memory (MB) during its runs goes there too (the
    most over this call and any before that filled the same dict)."""
    weights = copy.deepcopy(trainer.lm.state_dict())
    optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    times: dict[Any, list[float]] = {True: [], False: []}
    result = None
    for i, way in enumerate(ways):
        if i:
            trainer.lm.load_state_dict(weights)
            trainer.optimizer.load_state_dict(optimizer)
            if trainer.master is not None:  # bf16-master's working copy, from the masters
                trainer.master.refresh()
        if peaks is not None:
            resident_peak().reset()
        start = time.perf_counter()
        result = run(way)
        if way is not None:
            times.setdefault(way, []).append(time.perf_counter() - start)
            if peaks is not None:
                peaks[way] = max(peaks.get(way, 0.0), resident_peak().peak)
    return times, result


def add_regime_options(parser) -> None:
    """``--regime``, ``--gsm8k`` and ``--model``: the batch :func:`regime_trainer` samples."""
    from regimes import GSM8K, REGIMES  # bench/

    parser.add_argument("--regime", default="gsm8k-256", choices=list(REGIMES))
    parser.add_argument("--gsm8k", default=str(GSM8K))
    parser.add_argument("--model", default="smollm2-135m-instruct")


def regime_trainer(args, micro_batch_size: int | None = None,
                   reuse_sampler_forward: bool = True):
    """The trainer of ``bench/vs_trl.py``'s postrl run (fp32, one step, seed 0) at the regime
    :func:`add_regime_options` parsed into ``args``, on ``args.model``; ``micro_batch_size``
    None: the bench's."""
    from regimes import parse_regimes  # bench/
    from vs_trl import postrl_config

    from postrl.train.trainer import Trainer

    regime = parse_regimes(args.regime, Path(args.gsm8k))[0]
    config = postrl_config(1, seed=0, micro_batch_size=micro_batch_size, regime=regime)
    config.reuse_sampler_forward, config.model = reuse_sampler_forward, args.model
    return Trainer(config)


def update_ab(description: str, argv: list[str] | None,
              add_options: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """``(args, trainer)`` of an A/B of one batch's update: :func:`add_regime_options`,
    ``--reps`` (ABBA pairs), ``--micro-batch-size`` (default 16) and the script's own
    ``add_options``; the regime's trainer with the sampler's forward not read (the update
    then multiplies its own, whichever way it runs)."""
    parser = argparse.ArgumentParser(description=description)
    add_regime_options(parser)
    parser.add_argument("--reps", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    return args, regime_trainer(args, args.micro_batch_size, reuse_sampler_forward=False)


def on_first_batch(trainer, args, update: Callable[[Any], Any]) -> None:
    """``trainer``'s first step with ``update(batch)`` in place of its update; then what the
    batch held."""
    trainer.phases.update = update
    row = trainer.train_step()
    print(f"{args.regime}: responses of {row['length/mean']:.0f} tokens on average, the "
          f"longest {row['length/max']:.0f}; {args.micro_batch_size} rows per micro-batch")


def runs_text(times: list[float], peak: float) -> str:
    """One way's line: the median of its ``times``, each run, and its resident ``peak``."""
    return (f"update {statistics.median(times):.2f} s (runs: "
            f"{', '.join(f'{t:.2f}' for t in times)}), resident peak {peak:.0f} MB")


def first_prompt_ids(trainer, count: int = 4) -> list[list[int]]:
    """The token ids of the next ``count`` prompts ``trainer``'s sampler hands out, as its
    own steps build them (the task's chat prompt, the run's system prompt)."""
    return [trainer.draw.prompt(e)[1] for e in trainer.sampler.take(count)]


@functools.cache
def resident_peak() -> ResidentPeak:
    """The process's one :class:`ResidentPeak` (one sampling thread)."""
    return ResidentPeak()


class ResidentPeak:
    """The most resident memory (MB) seen since :meth:`reset`, sampled by a thread."""

    def __init__(self) -> None:
        self.peak = 0.0
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> float:
        fields = Path("/proc/self/statm").read_text().split()
        return int(fields[1]) * 4096 / 2**20

    def reset(self) -> None:
        self.peak = self.now()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(0.05)
