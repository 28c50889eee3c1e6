"""``reasoning_gym:NAME``: any procedural dataset of reasoning-gym (open-thought on GitHub).

The problems are ``size`` entries of reasoning-gym's generator for NAME, built with a fixed
reasoning-gym seed (``RG_SEED``) and the dataset's own config fields given as task options, so
the problem set depends only on the options; ``seed`` only orders ``train()``. Entries with the
same question are kept once, and the split is by a stable hash of the question (as
``split_by_hash`` does for the other tasks), so no question is in both splits.

The model sees reasoning-gym's question followed by ``ANSWER_INSTRUCTION``; the reward
``reasoning_gym`` (postrl.rewards.reasoning_gym) reads the first ``Answer:`` line and scores it
with the dataset's own ``score_answer``. reasoning-gym is an optional extra, imported only
when such a task is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from types import ModuleType
from typing import Any

from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits
from postrl.tasks.splits import (
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

# Appended to every question: reason first, then one line the verifier reads, with the
# template on a line of its own (studies/findings/pilot.md compares the instructions tried).
ANSWER_INSTRUCTION = (
    "\n\nThink step by step. Then write your final answer on the last line, starting with "
    '"Answer:", like this:\nAnswer: <answer>'
)
RG_SEED = 0  # reasoning-gym's generator seed: fixed, so the problems never follow `seed`
OWN_OPTIONS = ("seed", "test_fraction", "size")  # postrl's; the rest are the dataset's config
HIDDEN_FIELDS = ("seed", "size")  # config fields postrl sets itself


def import_reasoning_gym(name: str) -> ModuleType:
    """``reasoning_gym``, or a ConfigError saying which extra to install."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as error:
        raise ConfigError(
            f"task reasoning_gym:{name} needs the optional extra: "
            "pip install 'postrl[reasoning]'"
        ) from error


def config_class(name: str) -> type:
    """The config dataclass of reasoning-gym dataset ``name``; ConfigError with close names."""
    datasets = import_reasoning_gym(name).factory.DATASETS
    if name not in datasets:
        close = difflib.get_close_matches(name, sorted(datasets), n=5, cutoff=0.5)
        hint = (f"did you mean {', '.join(close)}?" if close
                else f"e.g. {', '.join(sorted(datasets)[:8])}")
        raise ConfigError(f"unknown reasoning-gym dataset '{name}' ({len(datasets)} known; {hint})")
    return datasets[name][1]


def dataset_fields(name: str) -> list[str]:
    """The config fields of dataset ``name`` a user may set (all but seed and size)."""
    return [f.name for f in dataclasses.fields(config_class(name))
            if f.name not in HIDDEN_FIELDS]


class ReasoningGymTask(FixedSplits):
    """Columns: ``answer`` (gold), ``metadata`` (the entry's), ``rg_dataset``, ``rg_config``
    (every option given to reasoning-gym, seed and size included) and ``rg_index`` (the entry's
    index), which the reward uses to rebuild the exact entry its scorer expects."""

    default_rewards: tuple[str, ...] = ("reasoning_gym",)

    def __init__(self, dataset: str, seed: int = 0, test_fraction: float = 0.1,
                 size: int = 2000, **fields: Any) -> None:
        self.dataset = dataset
        self.name = f"reasoning_gym:{dataset}"
        self.seed = check_int("seed", seed, 0)
        self.test_fraction = check_test_fraction(test_fraction)
        self.size = check_int("size", size, 2)
        check_fields(dataset, fields)
        self.config = {**fields, "seed": RG_SEED, "size": self.size}
        entries = self._generate()
        train, test = split_by_hash(((e["question"], e) for e in entries), self.test_fraction)
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(self._examples(train, "train"), self.seed))
        self._test = tuple(self._examples(test, "test"))

    @staticmethod
    def accepted_options(dataset: str) -> list[str]:
        """The options of ``reasoning_gym:<dataset>``: postrl's and the dataset's config."""
        return [*OWN_OPTIONS, *dataset_fields(dataset)]

    def _generate(self) -> list[dict[str, Any]]:
        """The dataset's entries 0..size-1 (with ``index``), each question kept once."""
        try:
            generator = import_reasoning_gym(self.dataset).create_dataset(
                self.dataset, **self.config)
            entries = [{**generator[index], "index": index} for index in range(self.size)]
        except ConfigError:
            raise
        except Exception as error:  # reasoning-gym validates its config with assert
            raise ConfigError(f"task {self.name}: reasoning-gym rejected the options "
                              f"{self.config}: {type(error).__name__}: {error}") from error
        unique: dict[str, dict[str, Any]] = {}
        for entry in entries:
            unique.setdefault(entry["question"], entry)
        return list(unique.values())

    def _examples(self, entries: list[dict[str, Any]], split: str) -> list[Example]:
        return [
            Example(
                id=f"{self.name}/{split}/{entry['index']}",
                question=entry["question"].rstrip() + ANSWER_INSTRUCTION,
                columns={"answer": entry["answer"], "metadata": entry["metadata"],
                         "rg_dataset": self.dataset, "rg_config": self.config,
                         "rg_index": entry["index"]},
            )
            for entry in entries
        ]


def check_fields(dataset: str, fields: dict[str, Any]) -> None:
    """ConfigError naming the first option that is neither postrl's nor a config field."""
    valid = dataset_fields(dataset)
    for option in fields:
        if option not in valid:
            raise ConfigError(
                f"task option '{option}' does not apply to task 'reasoning_gym:{dataset}' "
                f"(its options: {', '.join([*OWN_OPTIONS, *valid])})")
