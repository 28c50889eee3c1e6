"""The regime pilot of pilot.md: step-0 greedy and sampled pass@1 of SmolLM2-135M-Instruct on
a reasoning_gym task, by instruction, system prompt and temperature. One JSON spec per
argument, one JSON line per spec::

    python -m studies.findings.pilot '{"task": "reasoning_gym:basic_arithmetic",
        "options": {"max_digits": 1, "operators": ["+"]}, "n": 32, "temp": 0.5,
        "instruction": "current", "system": "You are a careful math tutor. ..."}'
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import postrl.tasks.reasoning_gym as rg_task
from postrl.models import load_policy
from postrl.tasks import load_task
from postrl.train.evaluate import EvalSettings, evaluate

INSTRUCTIONS = {  # appended to the question in place of ANSWER_INSTRUCTION
    "current": rg_task.ANSWER_INSTRUCTION,
    "answer-is": '\n\nExplain your reasoning briefly, then finish with the sentence '
                 '"The answer is <number>."',
    "steps-then": "\n\nSolve it step by step. End with a line of the form\nAnswer: <number>",
}


@dataclasses.dataclass(frozen=True)
class Reworded:
    """``task`` with each question's ANSWER_INSTRUCTION replaced by ``instruction``."""

    task: object
    instruction: str

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def default_rewards(self) -> tuple[str, ...]:
        return self.task.default_rewards

    def reworded(self, examples):
        return [dataclasses.replace(e, question=e.question.removesuffix(
            rg_task.ANSWER_INSTRUCTION) + self.instruction) for e in examples]

    def train(self):
        return self.reworded(self.task.train())

    def test(self):
        return self.reworded(self.task.test())


def main(specs: list[str]) -> None:
    model, tokenizer = load_policy("smollm2-135m-instruct")
    for spec in map(json.loads, specs):
        task = Reworded(load_task(spec["task"], **spec.get("options", {})),
                        INSTRUCTIONS[spec.get("instruction", "current")])
        started = time.perf_counter()
        result = evaluate(model, tokenizer, task, EvalSettings(
            spec.get("n", 24), ks=(1, 4), temperature=spec.get("temp", 1.0),
            max_new_tokens=spec.get("max_new_tokens", 192), system_prompt=spec.get("system")))
        print(json.dumps({**spec, "greedy": result.pass_at_1_greedy,
                          "sampled": result.pass_at_1_sampled,
                          "truncated": result.truncated_sampled,
                          "mean_length": result.mean_sampled_length,
                          "seconds": round(time.perf_counter() - started)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
