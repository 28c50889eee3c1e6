"""The public seam for measuring a step: the phases that work on its training batch.

``Trainer.phases`` holds what a step calls once its batch is assembled, in this order:

- ``prepare(batch)`` fills in what the update holds fixed: old and reference log-probs, the
  critic's values, advantages and returns (timed as ``time/reference_s``);
- ``update(batch)`` trains on the batch and returns the update's metrics (``time/train_s``).

Replace either to time it, keep its batch or run it several ways from one state (``bench/``'s
A/B scripts do): keep the one you replace and call it, and the step goes on as before::

    update = trainer.phases.update

    def timed(batch):
        start = time.perf_counter()
        metrics = update(batch)
        print(time.perf_counter() - start)
        return metrics

    trainer.phases.update = timed

The step times each phase around whatever is there, and nothing else in the trainer reads
these attributes; the trainer's private methods behind them are not part of the seam.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from postrl.train.batch import TrainBatch


@dataclass
class Phases:
    """A step's ``prepare`` and ``update`` of its training batch (see the module)."""

    prepare: Callable[[TrainBatch], None]
    update: Callable[[TrainBatch], dict[str, float]]
