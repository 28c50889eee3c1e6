"""Off-policy on purpose: which weights draw each step's samples, and two ways to run that.

With ``max_staleness=k`` the batch that step ``t`` trains on is drawn by the weights after
update ``max(0, t - k)`` (:func:`drawn_by`): a schedule, not a race, so a run is the same
whatever the machine's timing. ``k = 0`` is the synchronous trainer. The samples of step
``t`` are then ``min(t, k)`` updates old when they train (as AReaL's
``max_head_offpolicyness``, prime-rl's ``max_off_policy_steps`` and TRL's ``max_staleness``
bound them, but here every step's staleness is known before the run).

The schedule runs in one of two ways, with the same numbers:

- :class:`InOrder` draws, at the start of step ``t``, every batch the current weights are
  due to draw (batch ``t + k``; at ``t = 0`` batches ``0..k``), then hands over batch ``t``;
- :class:`Overlapped` draws in a thread beside the trainer, on its own copy of the weights,
  which the trainer publishes after each update (:meth:`Overlapped.publish`): batch ``j``
  waits for version :func:`drawn_by` ``(j)`` and is drawn while the trainer trains on
  earlier ones. The queue never holds more than ``k + 1`` batches.

Both call the same ``draw(step, engine)``; each batch's prompts and random streams depend on
its step alone, so the two give bit-identical batches when the forward is deterministic.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from postrl.train.sampling import Collected


def drawn_by(step: int, max_staleness: int) -> int:
    """The weights (counted in updates made) that draw the batch step ``step`` trains on."""
    return max(0, step - max_staleness)


@dataclass
class Drawn:
    """One step's samples as they were drawn, with what the metrics and a checkpoint need."""

    step: int  # the step that trains on them
    version: int  # the updates made to the weights that drew them
    collected: Collected
    reward_errors: int
    timings: dict[str, float]  # generate and score seconds
    sampler_position: tuple[int, int]  # the prompt sampler's (epoch, position) after them
    sampler_idle_s: float = 0.0  # what the sampler waited for the weights, before drawing
    finished_at: float = field(default_factory=time.perf_counter)

    @property
    def staleness(self) -> int:
        """The updates made between drawing and training (the step trains at version step)."""
        return self.step - self.version

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (no timings: a resumed run measures its own)."""
        return {"step": self.step, "version": self.version, "collected": self.collected,
                "reward_errors": self.reward_errors,
                "sampler_position": self.sampler_position}

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> Drawn:
        return cls(saved["step"], saved["version"], saved["collected"], saved["reward_errors"],
                   {"generate": 0.0, "score": 0.0}, tuple(saved["sampler_position"]))


@dataclass
class Queue:
    """The batches drawn for later steps when a checkpoint is saved, which it keeps (the
    weights that drew them are gone), and the prompt sampler's place after the last."""

    batches: list[Drawn] = field(default_factory=list)
    position: tuple[int, int] | None = None  # None: the prompt sampler's own

    def hold(self, batches: list[Drawn], trained: tuple[int, int]) -> None:
        """Keep ``batches``; ``trained``: the prompt sampler's place after the batch the
        last step trained on (where it stands when nothing is queued)."""
        self.batches = list(batches)
        self.position = batches[-1].sampler_position if batches else trained

    def saved(self) -> list[dict[str, Any]]:
        return [b.saved() for b in self.batches]

    def load(self, saved: list[dict[str, Any]]) -> None:
        self.batches = [Drawn.from_saved(s) for s in saved]
        self.position = None


def async_metrics(drawn: Drawn, trainer_idle_s: float, taken_at: float) -> dict[str, float]:
    """``async/*`` of the step that trains on ``drawn``: its samples' staleness in updates;
    how long they waited in the queue; how long the sampler waited for the weights that drew
    them and the trainer for them (0 in order, where nobody waits)."""
    return {"async/staleness_mean": float(drawn.staleness),
            "async/staleness_max": float(drawn.staleness),
            "async/queue_wait_s": max(0.0, taken_at - drawn.finished_at),
            "async/sampler_idle_s": drawn.sampler_idle_s,
            "async/trainer_idle_s": trainer_idle_s}


# ``draw(step, engine)``: step ``step``'s samples drawn by ``engine`` as it is now
Draw = Callable[[int, Any], Drawn]


@dataclass(frozen=True)
class Schedule:
    """Where a run's schedule starts: ``max_staleness``, the next step to train (``start``,
    its weights the version ``start``), the batches already drawn for it and later steps
    (``queued``, a resumed run's) and the last step to draw for (None: no end known)."""

    max_staleness: int
    start: int = 0
    queued: tuple[Drawn, ...] = ()
    last: int | None = None

    def first_to_draw(self) -> int:
        return max([self.start - 1, *(d.step for d in self.queued)]) + 1

    def end(self, step: int) -> int:
        """The last batch the weights of version ``step`` may have drawn."""
        due = step + self.max_staleness
        return due if self.last is None else min(due, self.last)


class InOrder:
    """The schedule in one thread: each batch is drawn at the start of the step whose weights
    are due to draw it, by ``engine``, the trainer's own sampler."""

    def __init__(self, draw: Draw, engine, schedule: Schedule) -> None:
        self.draw, self.engine, self.schedule = draw, engine, schedule
        self.pending = {d.step: d for d in schedule.queued}
        self.next = schedule.first_to_draw()

    def take(self, step: int) -> Drawn:
        """Batch ``step``, drawing first what the current weights (version ``step``) owe."""
        while self.next <= self.schedule.end(step):
            self.pending[self.next] = self.draw(self.next, self.engine)
            self.next += 1
        return self.pending.pop(step)

    def publish(self, version: int, model) -> None:
        """Nothing to do: the next draw runs on the trainer's own weights."""

    def queued(self, after: int) -> list[Drawn]:
        """The batches drawn for steps after ``after`` (a checkpoint at step ``after``)."""
        return [self.pending[s] for s in sorted(self.pending) if s > after]

    def close(self, wait: bool = True) -> None:
        """Nothing runs beside the trainer."""


# how the trainer's weights reach the sampler thread: ``copy(model)``, in the trainer's
# thread, what is handed over (the trainer goes on changing its own); ``load(weights)``, in
# the sampler's thread, puts them into the engine before it draws
Copy = Callable[[Any], dict[str, torch.Tensor]]
Load = Callable[[dict[str, torch.Tensor]], None]


def state_copy(model) -> dict[str, torch.Tensor]:
    """A copy of every tensor of ``model``'s state (what a sampler copy of it loads)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Overlapped:
    """The schedule with a sampler thread beside the trainer (see the module).

    ``engine`` holds the trainer's weights of the schedule's ``start`` (its own copy of them:
    a model of its own, or vLLM's); the weights of later versions reach it by ``copy`` and
    ``load``. A failure in the thread is raised by the next :meth:`take`."""

    def __init__(self, draw: Draw, engine, schedule: Schedule, copy: Copy, load: Load) -> None:
        self.draw, self.engine, self.schedule = draw, engine, schedule
        self.copy, self.load = copy, load
        self.k, self.last = schedule.max_staleness, schedule.last
        self.pending = {d.step: d for d in schedule.queued}
        self.next = schedule.first_to_draw()
        self.weights: dict[int, dict[str, torch.Tensor]] = {}  # published, not yet loaded
        self.version = schedule.start  # the version ``engine`` holds
        self.error: BaseException | None = None
        self.stopping = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="postrl-sampler", daemon=True)
        self.thread.start()

    def publish(self, version: int, model) -> None:
        """The trainer's weights after ``version`` updates, for the batch they are due to
        draw; copied now, as the trainer goes on changing its own."""
        if self.last is not None and version + self.k > self.last:
            return  # they draw nothing
        state = self.copy(model)
        with self.changed:
            self.weights[version] = state
            self.changed.notify_all()

    def take(self, step: int) -> Drawn:
        """Batch ``step``, waiting for the sampler if it is not drawn yet."""
        with self.changed:
            while step not in self.pending and self.error is None:
                self.changed.wait()
            if self.error is not None:
                raise self.error
            drawn = self.pending.pop(step)
            self.changed.notify_all()
            return drawn

    def queued(self, after: int) -> list[Drawn]:
        """The batches the schedule has drawn for steps after ``after`` by the time step
        ``after`` ends: those whose weights are at most ``after`` updates old. The thread
        may already hold the next one, which a checkpoint leaves out (the resumed run
        draws it again, the same)."""
        with self.changed:
            wanted = range(after + 1, self.schedule.end(after) + 1)
            while any(s not in self.pending for s in wanted) and self.error is None:
                self.changed.wait()
            if self.error is not None:
                raise self.error
            return [self.pending[s] for s in wanted]

    def close(self, wait: bool = True) -> None:
        """Stop the thread after the batch it is drawing (``wait``: until it has stopped)."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        if wait:
            self.thread.join()

    def _run(self) -> None:
        try:
            while self.last is None or self.next <= self.last:
                version = drawn_by(self.next, self.k)
                waited = time.perf_counter()
                with self.changed:
                    while not self.stopping and version != self.version and (
                            version not in self.weights):
                        self.changed.wait()
                    if self.stopping:
                        return
                    state = self.weights.pop(version, None)
                    for old in [v for v in self.weights if v < version]:
                        del self.weights[old]
                if state is not None:
                    self.load(state)
                    self.version = version
                idle = time.perf_counter() - waited
                drawn = self.draw(self.next, self.engine)
                drawn.sampler_idle_s = idle
                with self.changed:
                    self.pending[self.next] = drawn
                    self.next += 1
                    self.changed.notify_all()
        except BaseException as err:  # raised in the trainer's thread by take
            with self.changed:
                self.error = err
                self.changed.notify_all()


def sampler_copy(model):
    """The sampler thread's own copy of ``model`` (weights, LoRA adapters and all), without
    gradients."""
    own = copy.deepcopy(model)
    for parameter in own.parameters():
        parameter.requires_grad_(False)
        parameter.grad = None
    return own
