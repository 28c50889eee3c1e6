"""Rows without a gradient in a batch used once: forward only (for the diagnostics) against no
forward at all (the sampler's entropies standing in), and what recording those entropies costs
the sampler; each alternated in one process on the same batches.

    python bench/unscored_rows_ab.py update [--steps 6] [--reps 2]
    python bench/unscored_rows_ab.py sampler [--model tiny|smollm2] [--reps 40]

``update``: ``bench/vs_trl.py``'s postrl run (SmolLM2, fp32, 4 prompts x 8, 64 new tokens).
Each step's update runs both ways ``reps`` times from the same weights and optimizer state
(ABBA order), and one line per step gives the groups without variance, their tokens and the
medians. ``sampler``: ``generate`` on that run's prompts (``smollm2``) or on
``bench/recipe_steps.py``'s tiny-model run (``tiny``): the engine with and without recording
entropies, and with :func:`without_entropy`, the sampler before it could record them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import postrl.rollout.hf as hf
from postrl.rollout.sampling import next_tokens, truncate_logits, uniforms


def without_entropy(logits, params, generators, with_entropy=False):
    """``next_tokens`` as it was before the sampler could record entropies: the same tokens
    and log-probs (the entropies returned are zeros)."""
    logits = logits.float()
    scaled = logits / (params.temperature or 1.0)
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        truncated = truncate_logits(scaled, params.top_k, params.top_p)
        cdf = torch.softmax(truncated, dim=-1).double().cumsum(dim=-1)
        draws = uniforms(generators).to(cdf.device)
        tokens = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True)
        tokens = tokens.squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return tokens, picked, torch.zeros_like(picked)


def update(steps: int, reps: int) -> None:
    from ab import alternating, from_one_state  # bench/, this script's directory
    from vs_trl import postrl_config

    from postrl.train.trainer import Trainer

    trainer = Trainer(postrl_config(steps, seed=0))
    original = trainer.phases.update
    totals: dict[bool, list[float]] = {True: [], False: []}
    zero_groups: list[int] = []
    print(f"{'step':>4}{'zero-var groups':>17}{'their tokens':>14}{'forward only s':>16}"
          f"{'no forward s':>14}{'ratio':>7}")

    def both_ways(batch):
        def run(skip):
            return original(batch if skip else dataclasses.replace(batch, sampler_entropy=None))

        # the process's first update warms up (allocations, kernels)
        ways = alternating(reps) if totals[True] else [None, *alternating(reps)]
        times, metrics = from_one_state(trainer, run, ways)
        flat = batch.rewards.view(-1, batch.group_size)
        zero = (flat == flat[:, :1]).all(dim=1)
        tokens = int(batch.lengths.view(-1, batch.group_size)[zero].sum())
        forward, none = (statistics.median(times[way]) for way in (False, True))
        totals[False].append(forward)
        totals[True].append(none)
        zero_groups.append(int(zero.sum()))
        print(f"{trainer.step:>4}{int(zero.sum()):>17}{tokens:>14}{forward:>16.3f}{none:>14.3f}"
              f"{none / forward:>7.3f}", flush=True)
        return metrics  # the last run's: both ways give the same step

    trainer.phases.update = both_ways
    for _ in range(steps):
        trainer.train_step()
    print(f"sum of step medians: forward only {sum(totals[False]):.2f} s, "
          f"no forward {sum(totals[True]):.2f} s")
    with_zero = [i for i, share in enumerate(zero_groups) if share]
    print(f"steps with zero-variance groups ({len(with_zero)}): forward only "
          f"{sum(totals[False][i] for i in with_zero):.2f} s, no forward "
          f"{sum(totals[True][i] for i in with_zero):.2f} s")


def sampler(model: str, reps: int) -> None:
    from ab import first_prompt_ids  # bench/, this script's directory

    from postrl.train.trainer import Trainer

    if model == "tiny":
        from recipe_steps import recipe_config

        config = recipe_config("dr_grpo", 1)
    else:
        from vs_trl import postrl_config

        config = postrl_config(1, seed=0)
    trainer = Trainer(config)
    engine = trainer.engine
    prompts = first_prompt_ids(trainer)
    ways = {"before": (without_entropy, False), "without entropies": (next_tokens, False),
            "with entropies": (next_tokens, True)}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(reps):
        for way in (list(ways) if i % 2 else list(reversed(ways))):
            hf.next_tokens, engine.entropies = ways[way]
            start = time.perf_counter()
            out = engine.generate(prompts, 8, trainer.sampling, seed=i)
            times[way].append(time.perf_counter() - start)
    hf.next_tokens = next_tokens
    before = statistics.median(times["before"][2:])
    print(f"{model}: {int(out.lengths.sum())} tokens in the last call; generate, medians: "
          + ", ".join(f"{way} {statistics.median(t[2:]) * 1e3:.1f} ms "
                      f"({statistics.median(t[2:]) / before:.3f})" for way, t in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("update", "sampler"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=None,
                        help="runs of each way per step (update: 2) or calls (sampler: 40)")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    args = parser.parse_args()
    if args.what == "update":
        update(args.steps, args.reps or 2)
    else:
        sampler(args.model, args.reps or 40)


if __name__ == "__main__":
    main()
