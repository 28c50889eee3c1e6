"""The ``reasoning_gym`` reward: the first ``Answer:`` line, scored by the dataset's own scorer.

Which line: the FIRST line that either starts, after leading whitespace and markdown (``*``,
``_``, ``#``, ``>``, a list dash), with the word ``Answer`` and a colon, in any case, with
emphasis around either (``Answer:``, ``**Answer:**``, ``## Answer:``), or says ``the answer
is`` (``So, the answer is 8.``, ``The final answer is: 8``): the phrase small instruction-tuned
models write when asked for an answer line (SmolLM2-135M-Instruct often did in the pilot,
studies/findings/pilot.md), and the one chain-of-thought evaluations have long read.
What follows the colon or the phrase on that line, less surrounding ``*`` and one final full
stop, is the answer; everything after that line is ignored, so a second, different answer
later costs nothing and earns nothing. No such line, or nothing after it, scores 0.0.

How it is scored: reasoning-gym's ``score_answer(answer, entry)`` of the dataset, built once
per (dataset, options) with the options the task generated it with (the ``rg_config`` column)
and cached, on the entry rebuilt from its index (``rg_index``, cached too): rebuilt rather than
read back from the JSON columns because some scorers compare against tuples that JSON would
turn into lists (arc_agi, rearc). Some scorers give partial credit (e.g. 0.05 for a well-formed
wrong grid, or len(gold)/len(answer) when the gold is a substring); a sample counts as correct
only at 1.0. A scorer that raises on the model's text scores 0.0: garbage is a wrong answer,
not a failed run. One line holds the answer: datasets whose gold spans lines (grids, boards,
move lists) need a reward of their own (docs/rewards.md).
"""

from __future__ import annotations

import importlib
import json
import re
from functools import lru_cache
from typing import Any

from postrl.errors import ConfigError
from postrl.rewards.math_answer import completion_text

_ANSWER_LINE = re.compile(
    r"^[\s*_#>-]*answer[\s*_]*:(.*)$"  # Answer: 8
    r"|\bthe\s+(?:final\s+)?answer\s+is\b[\s*_]*:?(.*)$",  # So, the answer is 8.
    re.IGNORECASE)


def first_answer(text: str) -> str | None:
    """What follows ``Answer:`` on the first answer line (see the module docstring), or None
    when there is no answer line or nothing after its colon."""
    for line in text.splitlines():
        match = _ANSWER_LINE.search(line)
        if match:
            answer = (match.group(1) or match.group(2) or "").strip().strip("*").strip()
            answer = answer[:-1].rstrip() if answer.endswith(".") else answer
            answer = answer.strip("*").strip()  # "**12**." -> "12"
            return answer or None
    return None


@lru_cache(maxsize=32)
def _dataset(name: str, config_json: str) -> Any:
    """reasoning-gym's dataset ``name`` with the given options, built once."""
    try:
        reasoning_gym = importlib.import_module("reasoning_gym")
    except ImportError as error:
        raise ConfigError(f"reward reasoning_gym for dataset {name} needs the optional extra: "
                          "pip install 'postrl[reasoning]'") from error
    return reasoning_gym.create_dataset(name, **json.loads(config_json))


@lru_cache(maxsize=8192)
def _entry(name: str, config_json: str, index: int) -> dict[str, Any]:
    """Entry ``index`` of that dataset, exactly as its generator made it."""
    return _dataset(name, config_json)[index]


def score(answer: str | None, name: str, config: dict[str, Any], index: int) -> float:
    """The dataset's own score for ``answer`` on entry ``index``; 0.0 for no answer."""
    if answer is None:
        return 0.0
    key = json.dumps(config, sort_keys=True)
    scorer, entry = _dataset(name, key).score_answer, _entry(name, key, int(index))
    try:
        return float(scorer(answer, entry))
    except Exception:  # the scorer choked on the model's text: a wrong answer
        return 0.0


def reasoning_gym_reward(
    prompts: list[str], completions: list[Any], rg_dataset: list[str],
    rg_config: list[dict[str, Any]], rg_index: list[int], **_: Any,
) -> list[float | None]:
    """reasoning-gym's score of the first ``Answer:`` line (0.0 without one)."""
    return [
        score(first_answer(completion_text(completion)), name, config, index)
        for completion, name, config, index in zip(
            completions, rg_dataset, rg_config, rg_index, strict=True)
    ]
