"""`make demo`: evaluate SmolLM2-135M-Instruct on held-out problems, train it with a recipe
for a few minutes on this CPU, evaluate again, and print before/after accuracy.

    python examples/demo.py [--config examples/demo.yaml] [--recipe grpo] [--steps 25]
                            [--samples 8] [key=value ...]

The default config is held-out arithmetic (`make demo`); `make demo-env` runs
examples/guess_number.yaml, a multi-turn game whose accuracy is the share of episodes that
find the number, and `make demo-tools` examples/calculator.yaml, arithmetic with a calculator
tool whose accuracy is the share of episodes that answer with the tool's result. Held-out
problems are never trained on (each task's splits are disjoint by construction). Accuracy
is measured two ways: greedy pass@1, and the unbiased pass@1 of ``--samples`` samples at the
training temperature, the distribution the policy is trained at.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from postrl.config import load_config
from postrl.errors import PostRLError
from postrl.models import load_policy
from postrl.tasks import load_task
from postrl.train.evaluate import EvalSettings, evaluate
from postrl.train.trainer import Trainer

CONFIG = Path(__file__).with_name("demo.yaml")


def accuracy(model, tokenizer, cfg, samples: int) -> dict[str, float]:
    task = load_task(cfg.task, **cfg.task_options)
    settings = EvalSettings(None, [1, samples], cfg.temperature, cfg.max_new_tokens, seed=1234,
                            system_prompt=cfg.system_prompt, max_turns=cfg.max_turns,
                            stop=tuple(cfg.stop))
    result = evaluate(model, tokenizer, task, settings)
    scores = {"greedy pass@1": result.pass_at_1_greedy, "sampled pass@1": result.pass_at_k[1],
              f"pass@{samples}": result.pass_at_k[samples], "problems": result.n_problems}
    if result.called_sampled is not None:  # a task with tools: episodes with a call that ran
        scores |= {"greedy call": result.called_greedy, "sampled call": result.called_sampled}
    return scores


def reverse_kl(metrics: Path) -> tuple[float, float] | None:
    """A distillation run's held-out reverse KL to its teacher at its first and last
    evaluation (``eval/distill_reverse_kl``), or None."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    values = [row["eval/distill_reverse_kl"] for row in rows if "eval/distill_reverse_kl" in row]
    return (values[0], values[-1]) if len(values) > 1 else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="the run's YAML config")
    parser.add_argument("--samples", type=int, default=8,
                        help="samples per held-out problem for sampled pass@1 and pass@k (>= 2)")
    parser.add_argument("--recipe", default=None, help="recipe to train with (default: demo.yaml)")
    parser.add_argument("--steps", default=None, help="training steps (default: demo.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.samples < 2:
        parser.error(f"--samples must be >= 2, got {args.samples}")
    flags = [f"{k}={v}" for k, v in (("recipe", args.recipe), ("steps", args.steps)) if v]
    cfg = load_config(args.config, ["overwrite=true", *flags, *args.overrides])
    started = time.perf_counter()

    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    print(f"evaluating {cfg.model} on held-out {cfg.task} problems ...", flush=True)
    before = accuracy(model, tokenizer, cfg, args.samples)
    del model

    print(f"training with recipe {cfg.build_recipe().name} for {cfg.steps} steps ...", flush=True)
    trainer = Trainer(cfg)
    trainer.train()
    after = accuracy(trainer.lm, trainer.tokenizer, cfg, args.samples)

    minutes = (time.perf_counter() - started) / 60
    print(f"\n{'held-out accuracy':<16}{'before':>9}{'after':>9}{'change':>10}")
    keys = ["greedy pass@1", "sampled pass@1", f"pass@{args.samples}"]
    keys += [key for key in ("greedy call", "sampled call") if key in before]
    for key in keys:
        change = 100 * (after[key] - before[key])
        print(f"{key:<16}{before[key]:>9.1%}{after[key]:>9.1%}{change:>+9.1f}pt")
    tokens = trainer.state.tokens_generated
    if "greedy call" in before:
        print("(call: the share of episodes with a well-formed tool call, one that ran)")
    distilled = reverse_kl(cfg.run_dir() / "metrics.jsonl")
    if distilled:
        print("held-out reverse KL to the teacher: {:.3f} -> {:.3f} nats per token".format(
            *distilled))
    print(f"({before['problems']} problems; {tokens} training tokens generated; "
          f"{minutes:.1f} min in all; run in {cfg.run_dir()})")
    summary = {"before": before, "after": after, "minutes": minutes,
               "recipe": cfg.build_recipe().name, "steps": cfg.steps,
               "tokens_generated": tokens, "distill_reverse_kl": distilled}
    (cfg.run_dir() / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except PostRLError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("demo: interrupted (make demo starts it again from the beginning)", file=sys.stderr)
        sys.exit(130)
