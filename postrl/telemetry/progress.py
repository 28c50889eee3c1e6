"""What a person watching a training run sees: a progress bar with the headline numbers.

On an interactive terminal :class:`TrainProgress` draws a live rich bar (steps, and tokens
when there is a token budget) with one line of headline metrics under it. Anywhere else
(CI logs, pipes, files) it prints one compact plain line per step instead, so logs stay
readable and greppable. ``quiet=True`` prints nothing at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


def format_number(value: float) -> str:
    """Four significant digits (``0.4213``, ``37.25``, ``1.2e-05``); ``nan`` if not finite."""
    return f"{value:.4g}" if math.isfinite(value) else "nan"


def format_count(value: float) -> str:
    """A count in short form: ``950``, ``12.3k``, ``4.56M``."""
    if not math.isfinite(value):
        return "nan"
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.3g}{suffix}"
    return f"{value:.0f}"


def format_seconds(value: float) -> str:
    """Seconds with two decimals below a minute, else whole seconds."""
    if not math.isfinite(value):
        return "nan"
    return f"{value:.2f}s" if abs(value) < 60 else f"{value:.0f}s"


# (metric, label, formatter): the numbers shown, in this order, when a step logs them.
HEADLINE: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("reward/mean", "reward", format_number),
    ("accuracy/mean", "acc", format_number),
    ("loss/total", "loss", format_number),
    ("kl/mean", "kl", format_number),
    ("length/mean", "len", format_number),
    ("rollout/tokens_generated", "tokens", format_count),
    ("time/step_s", "step", format_seconds),
)


def headline(metrics: Mapping[str, Any], token_budget: int | None = None) -> str:
    """The headline numbers present in ``metrics``, e.g. ``reward 0.42  acc 0.31  ...``.

    Missing metrics (no ``kl/mean`` without a KL term) and None values are left out.
    """
    parts = []
    for name, label, formatter in HEADLINE:
        value = metrics.get(name)
        if value is None:
            continue
        text = formatter(float(value))
        if name == "rollout/tokens_generated" and token_budget:
            text += "/" + format_count(token_budget)
        parts.append(f"{label} {text}")
    return "  ".join(parts)


def plain_line(step: int, total_steps: int | None, text: str) -> str:
    """One line for non-interactive output: ``step 3/10  reward 0.42  ...``."""
    position = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    return f"{position}  {text}" if text else position


class _BarWithHeadline(Progress):
    """A rich Progress whose live display adds one text line under the bars."""

    headline_text: Text = Text("")

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        if self.headline_text.plain:
            yield self.headline_text


class TrainProgress:
    """Progress display for a training loop; use it as a context manager.

    ``total_steps`` and ``token_budget`` are the run's stopping rules (either may be None).
    Call :meth:`update` after each optimizer step with the number of steps completed so far
    (1 after the first step) and that step's metrics.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        token_budget: int | None = None,
        *,
        quiet: bool = False,
        console: Console | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.token_budget = token_budget
        self.quiet = quiet
        self.console = console or Console()
        self._bar: _BarWithHeadline | None = None
        self._step_task: TaskID | None = None
        self._token_task: TaskID | None = None

    @property
    def live(self) -> bool:
        """True when a live bar is drawn (interactive terminal, not quiet)."""
        return not self.quiet and self.console.is_interactive

    def __enter__(self) -> TrainProgress:
        if self.live:
            self._start_bar()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show the state after ``step`` completed optimizer steps."""
        if self.quiet:
            return
        text = headline(metrics, self.token_budget)
        if self._bar is None:
            line = plain_line(step, self.total_steps, text)
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        self._bar.headline_text = Text(text)
        if self._step_task is not None:
            self._bar.update(self._step_task, completed=step)
        tokens = metrics.get("rollout/tokens_generated")
        if self._token_task is not None and tokens is not None:
            self._bar.update(self._token_task, completed=float(tokens))

    def _start_bar(self) -> None:
        self._bar = _BarWithHeadline(
            TextColumn("[bold]{task.description:>6}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        if self.total_steps is not None or self.token_budget is None:
            self._step_task = self._bar.add_task("steps", total=self.total_steps)
        if self.token_budget is not None:
            self._token_task = self._bar.add_task("tokens", total=self.token_budget)
        self._bar.start()
