"""What a run is and where it stands: the one place the trainer, its metrics, its
checkpoints and its Ray workers read them from, instead of the trainer itself.

:class:`RunState` is where the run stands (steps, tokens, skipped updates): a step advances
it, the metrics report it, a checkpoint saves it as ``counters`` and resume restores it
(docs/reliability.md). :class:`RunObjects` are the objects that hold the run's learned and
random state (weights, optimizers, schedule, shuffling), which a checkpoint saves, resume
loads in place, and Ray's workers start from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from postrl.errors import ConfigError
from postrl.train.sampling import Collected, PromptSampler
from postrl.train.staleness import Queue


@dataclass
class RunState:
    """Where a run stands after ``step`` steps (a checkpoint's ``counters``, by these names)."""

    step: int = 0  # steps finished
    tokens_generated: int = 0  # response tokens sampled, those of discarded groups included
    tokens_wasted: int = 0  # those of groups that dynamic sampling discarded
    responses: int = 0  # responses sampled
    skipped_steps: int = 0  # steps whose update a non-finite loss or gradient skipped
    skipped_in_a_row: int = 0  # of those, the latest steps in a row

    def counters(self) -> dict[str, int]:
        """What a checkpoint saves as ``counters``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_counters(cls, counters: dict[str, int], where: str) -> RunState:
        """The state a checkpoint's ``counters`` (at ``where``) saved; a counter it does not
        hold (saved before that counter was added) starts at 0."""
        unknown = sorted(set(counters) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"cannot resume from {where}: it counts {', '.join(unknown)}, "
                              "which this version of postrl does not know (a newer postrl "
                              "wrote it); resume it with that version")
        return cls(**counters)

    def count_sampled(self, collected: Collected) -> None:
        """Add a step's sampling: every response generated, discarded ones included."""
        self.tokens_generated += collected.tokens_generated
        self.tokens_wasted += collected.tokens_wasted
        self.responses += sum(g.rollouts.response_ids.shape[0] for g in collected.generated)

    def count_update(self, skipped: bool) -> None:
        """Count a step's update: skipped (a non-finite loss or gradient) or made."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.skipped_steps += int(skipped)


@dataclass
class RunObjects:
    """The objects whose state a checkpoint saves and resume loads in place (with the RNG
    states and the :class:`RunState`); Ray's workers start from the first four."""

    policy: nn.Module  # the causal LM (its LoRA adapters injected)
    critic: nn.Module | None
    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler
    update_generator: torch.Generator  # draws each update's minibatches
    sampler: PromptSampler  # the prompts' order
    queue: Queue  # batches drawn for later steps (max_staleness > 0)
