"""Held-out evaluation: pass@1 with greedy decoding and the unbiased pass@k estimator.

``postrl eval --model PATH_OR_RUN --task SPEC`` generates on the first ``n`` test problems of a
task and checks each completion with the task's verifier (its first default reward: a sample is
correct iff that reward is 1.0).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from postrl.envs import is_environment_task
from postrl.errors import ConfigError
from postrl.rewards import Scorer
from postrl.rollout import HFRolloutEngine, Rollouts, SamplingParams
from postrl.rollout.base import EpisodeStats
from postrl.rollout.episodes import EpisodeLimits, play_examples
from postrl.tasks import Example, Task, task_prompt

if TYPE_CHECKING:
    from postrl.config import TrainConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k).

    Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1 (the chance that
    k samples drawn without replacement from the n include a correct one). The ratio is the
    product prod_{i=0}^{k-1} (n-c-i) / (n-i), which never forms the huge binomials.
    """
    if n < 1 or k < 1:
        raise ValueError(f"pass@k needs n >= 1 and k >= 1, got n={n}, k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n (k={k} of only n={n} samples)")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass
class ProblemResult:
    """One problem: how many of its sampled completions were correct (0 when none were
    sampled), and whether the greedy one was."""

    id: str
    correct: int
    greedy_correct: bool


@dataclass
class EvalResult:
    """Means over problems; ``pass_at_k`` is empty when no k > 1 was asked (no sampling).

    ``mean_length`` is over the greedy completions (tokens), ``mean_sampled_length`` over the
    sampled ones (None without sampling). ``pass_at_1_sampled`` is the mean over problems of
    correct / samples (equal to ``pass_at_k[1]`` when 1 is among the ks), None without sampling.
    ``truncated_greedy`` and ``truncated_sampled`` are the shares of completions that stopped at
    ``max_new_tokens`` without ending (an EOS or a stop string): a high share means the budget,
    not the model, decided many answers. ``called_greedy`` and ``called_sampled``, for a task
    with tools, are the shares of episodes with at least one well-formed tool call (one that
    ran: a known tool, readable arguments), None for other tasks.
    """

    task: str
    model: str
    n_problems: int
    samples_per_problem: int
    temperature: float
    pass_at_1_greedy: float
    pass_at_k: dict[int, float]
    mean_length: float
    mean_sampled_length: float | None
    seconds: float
    per_problem: list[ProblemResult] = field(default_factory=list)
    pass_at_1_sampled: float | None = None
    truncated_greedy: float = 0.0
    truncated_sampled: float | None = None
    called_greedy: float | None = None  # a tool task's episodes with a call that ran
    called_sampled: float | None = None


def count_correct(
    verifier: str, examples: Sequence[Example], prompts: Sequence[str],
    completions: Sequence[str], group_size: int, extra: dict[str, list] | None = None,
) -> list[int]:
    """Correct completions per example; the ``group_size`` completions of each are adjacent.
    ``extra`` columns are per completion (an episode's ``env_reward``)."""
    if len(completions) != len(examples) * group_size:
        raise ValueError(f"{len(completions)} completions for {len(examples)} x {group_size}")
    rows = [example for example in examples for _ in range(group_size)]
    names = dict.fromkeys(name for example in examples for name in example.columns)
    columns = {name: [row.columns.get(name) for row in rows] for name in names} | (extra or {})
    row_prompts = [prompt for prompt in prompts for _ in range(group_size)]
    scorer = Scorer([(verifier, 1.0)])
    scored = scorer.score(row_prompts, list(completions), columns)
    flags = [value == 1.0 for value in scored.per_function[scorer.names[0]]]
    return [sum(flags[i * group_size : (i + 1) * group_size]) for i in range(len(examples))]


@dataclass(frozen=True)
class Sampler:
    """What every evaluation batch samples with: the engine, its tokenizer, and for an
    environment task that task and its episodes' limits (None: single-turn)."""

    engine: HFRolloutEngine
    tokenizer: Any
    episodes: tuple[Task, EpisodeLimits] | None

    def prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                for prompt in prompts]

    def rollouts(self, examples: list[Example], ids: list[list[int]], group_size: int,
                 params: SamplingParams, seed: int) -> Rollouts:
        """``group_size`` samples of each example's prompt ``ids``: for an environment task,
        each a multi-turn episode."""
        if self.episodes is None:
            return self.engine.generate(ids, group_size, params, seed)
        task, limits = self.episodes
        return play_examples(self.engine, self.tokenizer, task, examples, ids, group_size,
                             params, seed, limits)

    def generate(self, examples: list[Example], prompts: list[str], group_size: int,
                 params: SamplingParams, seed: int) -> Sampled:
        """The samples' texts, generated lengths, finish reasons and episode statistics."""
        rollouts = self.rollouts(examples, self.prompt_ids(prompts), group_size, params, seed)
        return Sampled(rollouts.texts, rollouts.generated_lengths.tolist(),
                       [reason == "length" for reason in rollouts.finish_reasons],
                       rollouts.episodes)


@dataclass(frozen=True)
class Sampled:
    """One evaluation batch: texts, generated lengths, whether each stopped at
    ``max_new_tokens`` (finish reason length), and an environment task's episode statistics
    (None: single-turn)."""

    texts: list[str]
    lengths: list[int]
    truncated: list[bool]
    episodes: EpisodeStats | None

    @property
    def extra(self) -> dict[str, list]:
        """The columns the rewards need besides the examples' (an episode's ``env_reward``)."""
        return {} if self.episodes is None else {"env_reward": list(self.episodes.rewards)}

    @property
    def called(self) -> list[bool]:
        """Per sample: whether it made a tool call that ran (none for single-turn ones)."""
        if self.episodes is None:
            return [False] * len(self.texts)
        return [calls > errors for calls, errors in zip(self.episodes.tool_calls,
                                                        self.episodes.tool_errors, strict=True)]


@dataclass(frozen=True)
class EvalSettings:
    """What :func:`evaluate` measures: greedy pass@1 and, when some k of ``ks`` > 1, pass@k
    from ``max(ks)`` samples per problem at ``temperature``, on the first ``n`` test problems
    (all when None), ``batch_prompts`` prompts at a time."""

    n: int | None
    ks: Sequence[int] = (1,)
    temperature: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    system_prompt: str | None = None
    batch_prompts: int = 8
    max_turns: int = 4  # an environment task's episodes
    stop: tuple[str, ...] = ()  # strings that end a response (a turn), as in training


def evaluate(model: Any, tokenizer: Any, task: Task, settings: EvalSettings,
             model_name: str = "") -> EvalResult:
    """Greedy pass@1 and (when some k > 1) unbiased pass@k, as ``settings`` say."""
    n, ks, temperature = settings.n, settings.ks, settings.temperature
    max_new_tokens, seed, batch_prompts = (settings.max_new_tokens, settings.seed,
                                           settings.batch_prompts)
    if not ks or any(k < 1 for k in ks):
        raise ConfigError(f"ks must be positive integers, got {list(ks)}")
    if n is not None and n < 1:
        raise ConfigError(f"n must be >= 1 (or None for all), got {n}")
    start = time.perf_counter()
    examples = list(task.test())[:n]
    samples = max(ks) if max(ks) > 1 else 0
    verifier = task.default_rewards[0]
    episodes = ((task, EpisodeLimits.for_model(settings.max_turns, max_new_tokens, model))
                if is_environment_task(task) else None)
    sampler = Sampler(HFRolloutEngine(model, tokenizer), tokenizer, episodes)
    stop = tuple(settings.stop)
    greedy_params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)
    sample_params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                   stop=stop)
    greedy, correct, lengths, sampled_lengths = [], [], [], []
    truncated, sampled_truncated, called, sampled_called = [], [], [], []
    for index in range(0, len(examples), batch_prompts):
        chunk = examples[index : index + batch_prompts]
        prompts = [task_prompt(tokenizer, task, ex.question, settings.system_prompt)
                   for ex in chunk]
        out = sampler.generate(chunk, prompts, 1, greedy_params, seed)
        greedy += count_correct(verifier, chunk, prompts, out.texts, 1, out.extra)
        lengths += out.lengths
        truncated += out.truncated
        called += out.called
        if samples:
            out = sampler.generate(chunk, prompts, samples, sample_params, seed + index)
            correct += count_correct(verifier, chunk, prompts, out.texts, samples, out.extra)
            sampled_lengths += out.lengths
            sampled_truncated += out.truncated
            sampled_called += out.called
    tools = bool(getattr(task, "tools", ())) and episodes is not None
    return EvalResult(
        task=getattr(task, "name", type(task).__name__), model=model_name,
        n_problems=len(examples), samples_per_problem=samples, temperature=temperature,
        pass_at_1_greedy=_mean(greedy),
        pass_at_k={k: _mean([pass_at_k(samples, c, k) for c in correct])
                   for k in sorted(set(ks))} if samples else {},
        mean_length=_mean(lengths),
        mean_sampled_length=_mean(sampled_lengths) if samples else None,
        seconds=time.perf_counter() - start,
        per_problem=[ProblemResult(ex.id, correct[i] if samples else 0, bool(greedy[i]))
                     for i, ex in enumerate(examples)],
        pass_at_1_sampled=_mean([c / samples for c in correct]) if samples else None,
        truncated_greedy=_mean(truncated),
        truncated_sampled=_mean(sampled_truncated) if samples else None,
        called_greedy=_mean(called) if tools else None,
        called_sampled=_mean(sampled_called) if tools and samples else None,
    )


def training_eval(model: Any, tokenizer: Any, task: Task, cfg: TrainConfig) -> dict[str, float]:
    """The trainer's held-out metrics: greedy and (``eval_samples`` > 1) sampled pass@1 on the
    first ``eval_n`` test problems at the training temperature, with the run's seed, so every
    recipe of one seed is scored on the same problems and sampling seeds and arms pair."""
    started = time.perf_counter()
    ks = (1, cfg.eval_samples) if cfg.eval_samples > 1 else (1,)
    settings = EvalSettings(cfg.eval_n, ks=ks, temperature=cfg.temperature,
                            max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                            system_prompt=cfg.system_prompt, max_turns=cfg.max_turns,
                            stop=tuple(cfg.stop))
    result = evaluate(model, tokenizer, task, settings)
    metrics = {"eval/accuracy": result.pass_at_1_greedy, "eval/mean_length": result.mean_length,
               "time/eval_s": time.perf_counter() - started}
    if result.pass_at_1_sampled is not None:
        metrics["eval/sampled_accuracy"] = result.pass_at_1_sampled
        metrics["eval/truncated_frac"] = result.truncated_sampled
    return metrics


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def resolve_eval_model(path_or_run: str) -> str:
    """A run directory (``runs/NAME`` with ``final/config.json``) -> its ``final`` policy;
    anything else is returned unchanged (a model spec as for ``load_policy``)."""
    final = Path(path_or_run).expanduser() / "final"
    return str(final) if (final / "config.json").is_file() else path_or_run


# --- the `postrl eval` command ---------------------------------------------------------------


def parse_ks(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``; ConfigError naming ``--k`` for anything but positive integers."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise ConfigError(f"--k must be positive integers separated by commas, got {text!r}")
    return ks


def parse_task_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["digits=2", "operators=+-"]`` -> ``{"digits": 2, "operators": "+-"}`` (YAML scalars)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"--task-option must be KEY=VALUE, got {pair!r}")
        options[key.strip()] = yaml.safe_load(value) if value.strip() else value
    return options


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``postrl eval``."""
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct",
        help="smollm2-135m-instruct, tiny, a Hugging Face directory or a run directory")
    add("--task", default="arithmetic", help="task spec, e.g. arithmetic or gsm8k:PATH")
    add("--task-option", action="append", default=[], metavar="KEY=VALUE",
        help="a task option (repeatable), e.g. digits=2")
    add("--n", type=int, default=200, help="evaluate the first N test problems")
    add("--k", default="1,8", help="comma-separated k for unbiased pass@k (Chen et al. 2021)")
    add("--temperature", type=float, default=1.0, help="sampling temperature for pass@k")
    add("--max-new-tokens", type=int, default=64, help="tokens generated per completion")
    add("--seed", type=int, default=0, help="seed of the sampling")
    add("--system-prompt", default=None, help="system prompt for the chat template")
    add("--max-turns", type=int, default=4,
        help="an environment task's episodes: at most this many model turns")
    add("--stop", action="append", default=[], metavar="TEXT",
        help="a string that ends a response, or a turn of an episode (repeatable; \\n and "
        "\\t are read as a newline and a tab)")
    add("--json", action="store_true", help="print one JSON object instead of a table")


def run_eval(args: argparse.Namespace) -> int:
    """``postrl eval``: load, evaluate, print a table (or JSON with ``--json``)."""
    from postrl.models import load_policy
    from postrl.tasks import load_task

    ks = parse_ks(args.k)
    if args.n < 1:
        raise ConfigError(f"--n must be >= 1, got {args.n}")
    if args.max_turns < 1:
        raise ConfigError(f"--max-turns must be >= 1, got {args.max_turns}")
    if any(not text for text in args.stop):
        raise ConfigError("--stop strings must be non-empty")
    spec = resolve_eval_model(args.model)
    task = load_task(args.task, **parse_task_options(args.task_option))
    model, tokenizer = load_policy(spec, seed=args.seed)
    settings = EvalSettings(args.n, ks, args.temperature, args.max_new_tokens, args.seed,
                            args.system_prompt, max_turns=args.max_turns,
                            stop=tuple(text.replace("\\n", "\n").replace("\\t", "\t")
                                       for text in args.stop))
    result = evaluate(model, tokenizer, task, settings, model_name=spec)
    print(json.dumps(asdict(result)) if args.json else format_result(result))
    return 0


def format_result(result: EvalResult) -> str:
    """A short plain-text table of the headline numbers."""
    rows = [("pass@1 (greedy)", f"{result.pass_at_1_greedy:.3f}")]
    rows += [(f"pass@{k} (T={result.temperature:g}, {result.samples_per_problem} samples)",
              f"{value:.3f}") for k, value in result.pass_at_k.items()]
    if result.pass_at_1_sampled is not None and 1 not in result.pass_at_k:
        rows.append((f"pass@1 (T={result.temperature:g}, {result.samples_per_problem} samples)",
                     f"{result.pass_at_1_sampled:.3f}"))
    rows += [(f"episodes with a tool call that ran ({way})", f"{share:.1%}")
             for way, share in (("greedy", result.called_greedy),
                                ("sampled", result.called_sampled)) if share is not None]
    rows += [("mean length (greedy, tokens)", f"{result.mean_length:.1f}"),
             ("truncated at max_new_tokens (greedy)", f"{result.truncated_greedy:.1%}")]
    if result.mean_sampled_length is not None and result.truncated_sampled is not None:
        rows += [("mean length (sampled, tokens)", f"{result.mean_sampled_length:.1f}"),
                 ("truncated at max_new_tokens (sampled)", f"{result.truncated_sampled:.1%}")]
    rows.append(("seconds", f"{result.seconds:.1f}"))
    width = max(len(name) for name, _ in rows)
    head = f"{result.model} on {result.task} ({result.n_problems} test problems)"
    return "\n".join([head, *(f"  {name:<{width}}  {value}" for name, value in rows)])
