"""``load_task(spec, **options)``: from a task spec such as ``"gsm8k:data/train.jsonl"`` to a Task.

Every task accepts ``seed`` (the order of ``train()``) and ``test_fraction``; the others are
listed by :func:`task_options` (for ``reasoning_gym:NAME``, by the dataset NAME's config; for
``textarena:NAME``, by the game's constructor). An unknown spec or option is a ConfigError
naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from postrl.errors import ConfigError
from postrl.tasks.arithmetic import ArithmeticTask
from postrl.tasks.base import Task
from postrl.tasks.calculator import CalculatorTask
from postrl.tasks.countdown import CountdownTask
from postrl.tasks.files import load_file_task, load_gsm8k, load_saved_dataset, load_table
from postrl.tasks.guess_number import GuessNumberTask
from postrl.tasks.openenv import OpenEnvTask
from postrl.tasks.reasoning_gym import ReasoningGymTask
from postrl.tasks.textarena import TextArenaTask

TASK_FORMS = (
    "arithmetic",
    "countdown",
    "guess_number (a multi-turn guessing game: the environment answers higher or lower)",
    "calculator (multi-step arithmetic with a calculator tool)",
    "gsm8k:PATH (GSM8K-format JSONL, or a folder with train.jsonl and test.jsonl)",
    "jsonl:PATH",
    "parquet:PATH",
    "reasoning_gym:NAME (a reasoning-gym dataset, e.g. chain_sum; pip install 'postrl[reasoning]')",
    "textarena:NAME (a single-player TextArena game played as episodes, e.g. GuessTheNumber-v0; "
    "pip install 'postrl[textarena]')",
    "openenv:MODULE:CLASS (an OpenEnv environment class played as episodes in this process; "
    "pip install 'postrl[openenv]')",
    "DIR (a dataset saved with datasets' save_to_disk)",
)
BUILT_IN: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "guess_number": GuessNumberTask,
    "calculator": CalculatorTask,
}
FILE_KINDS: dict[str, Callable[..., Task]] = {
    "gsm8k": load_gsm8k,
    "jsonl": partial(load_table, "jsonl"),
    "parquet": partial(load_table, "parquet"),
}
# KIND:NAME specs whose options depend on NAME (the factory's ``accepted_options(NAME)``).
NAMED_KINDS: dict[str, Callable[..., Task]] = {"reasoning_gym": ReasoningGymTask,
                                               "textarena": TextArenaTask,
                                               "openenv": OpenEnvTask}
# Parameters of the loaders that are not options a user sets.
INTERNAL_PARAMETERS = {"self", "kind", "path", "fields", "reader"}


def load_task(spec: str, **options: Any) -> Task:
    """Build the task named by ``spec``; see ``TASK_FORMS`` for the forms a spec may take."""
    factory, path = resolve_spec(spec)
    check_options(spec, factory, options, path)
    return factory(**options) if path is None else factory(path, **options)


def resolve_spec(spec: str) -> tuple[Callable[..., Task], str | None]:
    """The factory for ``spec`` and the path it names, if any."""
    spec = spec.strip()
    if spec in BUILT_IN:
        return BUILT_IN[spec], None
    kind, colon, path = spec.partition(":")
    if colon and kind in FILE_KINDS:
        if not path:
            raise ConfigError(f"task '{spec}': a path is needed after '{kind}:'")
        return FILE_KINDS[kind], path
    if colon and kind in NAMED_KINDS:
        if not path.strip():
            raise ConfigError(f"task '{spec}': a dataset name is needed after '{kind}:'")
        return NAMED_KINDS[kind], path.strip()
    if spec and Path(spec).is_dir():
        return load_saved_dataset, spec
    forms = "\n  ".join(TASK_FORMS)
    raise ConfigError(f"unknown task '{spec}'; a task is one of:\n  {forms}")


def task_options(factory: Callable[..., Task], path: str | None = None) -> list[str]:
    """The option names ``factory`` accepts, following ``**options`` to ``load_file_task``;
    a factory with ``accepted_options`` (``reasoning_gym:NAME``) says them for ``path``."""
    accepted_options = getattr(factory, "accepted_options", None)
    if accepted_options is not None:
        return list(accepted_options(path))
    signature = inspect.signature(factory)
    names = [name for name in signature.parameters if name not in INTERNAL_PARAMETERS]
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds:
        names = [name for name in names if name != "options"]
        names += [name for name in task_options(load_file_task) if name not in names]
    return names


def check_options(spec: str, factory: Callable[..., Task], options: dict[str, Any],
                  path: str | None = None) -> None:
    """Raise a ConfigError naming the first option ``factory`` does not accept."""
    accepted = task_options(factory, path)
    for name in options:
        if name not in accepted:
            raise ConfigError(
                f"task option '{name}' does not apply to task '{spec}' "
                f"(its options: {', '.join(accepted)})"
            )
