"""Every metric postrl logs, declared once: name, unit and meaning.

Names are ``area/what``. ``docs/metrics.md`` is generated from this table
(``python -m postrl.telemetry.docs``) and a test keeps the two in sync. Trainers log only
declared names (``reward/<fn>/mean`` is the one pattern: one per reward function).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    meaning: str


METRICS: tuple[Metric, ...] = (
    # progress and budget
    Metric("step", "steps", "optimizer steps taken (one per rollout batch and update round)"),
    Metric("rollout/tokens_generated", "tokens", "cumulative generated tokens, wasted ones included"),
    Metric("rollout/tokens_wasted", "tokens", "cumulative tokens generated for groups dropped by dynamic sampling"),
    Metric("rollout/responses", "responses", "cumulative responses generated"),
    Metric("rollout/sampling_rounds", "rounds", "generation rounds this step (more than 1 with dynamic sampling)"),
    Metric("rollout/prefill_tokens", "tokens", "prompt and context tokens the sampler fed through a prefill this step; cached ones (an episode's earlier turns, vLLM's prefix cache) not counted"),
    # rewards and answers
    Metric("reward/mean", "reward", "mean total reward of the responses trained on this step"),
    Metric("reward/std", "reward", "standard deviation of the total reward over those responses"),
    Metric("reward/<fn>/mean", "reward", "mean of one reward function (None values left out)"),
    Metric("accuracy/mean", "fraction", "share of responses whose answer the task's verifier accepts"),
    Metric("advantage/mean", "advantage", "mean advantage over valid tokens"),
    Metric("advantage/abs_mean", "advantage", "mean absolute advantage over valid tokens"),
    # batch filters
    Metric("batch/zero_variance_frac", "fraction", "share of generated groups whose rewards are all equal (before filtering)"),
    Metric("batch/groups_kept", "groups", "groups that reach the loss this step"),
    Metric("batch/overlong_filtered", "responses", "truncated responses masked out by overlong filtering"),
    # lengths
    Metric("length/mean", "tokens", "mean response length"),
    Metric("length/max", "tokens", "longest response"),
    Metric("length/correct_mean", "tokens", "mean length of responses with a correct answer"),
    Metric("length/incorrect_mean", "tokens", "mean length of responses with a wrong answer"),
    Metric("length/truncated_frac", "fraction", "share of responses that hit max_new_tokens"),
    # multi-turn episodes (environment tasks); lengths above count the model's tokens only
    Metric("episode/turns_mean", "turns", "mean model turns per episode"),
    Metric("episode/out_of_turns_frac", "fraction", "share of episodes cut by max_turns before the environment ended them"),
    Metric("episode/env_tokens_mean", "tokens", "mean environment tokens per episode (context only: never trained on or counted in a normaliser)"),
    Metric("episode/tool_calls", "calls", "tool calls this step"),
    Metric("episode/tool_errors", "calls", "tool calls that failed this step (each became an observation)"),
    Metric("time/env_s", "s", "seconds spent in the environments' step() this step (part of time/generate_s)"),
    # loss
    Metric("loss/total", "loss", "the optimised loss, all terms, averaged over update rounds"),
    Metric("loss/policy", "loss", "policy term under the recipe's aggregation"),
    Metric("loss/per_token", "loss", "policy term under token_mean, whatever the recipe optimises"),
    Metric("loss/per_response", "loss", "policy term under seq_mean_token_mean, whatever the recipe optimises"),
    Metric("loss/kl", "loss", "beta * KL term, when the KL is in the loss"),
    Metric("loss/entropy_bonus", "loss", "entropy_coef * entropy, when the bonus is on"),
    Metric("loss/value", "loss", "critic's clipped value loss (PPO)"),
    Metric("kl/mean", "nats", "token-mean KL estimate to the reference policy"),
    Metric("entropy/mean", "nats",
           "token-mean entropy of the policy on the sampled tokens' positions, before "
           "top-k/top-p; for rows without a gradient in a batch used once, as the sampler "
           "computed it (the same policy; the update skips their forward)"),
    # ratios and clipping
    Metric("clip/low_frac", "fraction", "terms whose lower clip bound was active (A < 0)"),
    Metric("clip/high_frac", "fraction", "terms whose upper clip bound was active (A > 0)"),
    Metric("clip/dual_frac", "fraction", "terms bounded by dual-clip"),
    Metric("clip/token_frac", "fraction", "share of tokens whose clip bound (low or high) was active, counted per token for every ratio unit: GSPO's unit"),
    Metric("ratio/mean", "ratio", "mean importance ratio of the recipe's unit"),
    Metric("ratio/min", "ratio", "smallest importance ratio"),
    Metric("ratio/max", "ratio", "largest importance ratio"),
    Metric("ratio/seq_std", "ratio", "standard deviation over responses of the sequence ratio s_i"),
    Metric("ratio/token_logratio_std", "nats", "mean over responses of the std of their token log-ratios"),
    # the sampler is not the trainer (over the rows the update scored; postrl/objectives/mismatch.py)
    Metric("mismatch/kl_k1", "nats", "k1 estimate of KL(sampler || trainer) per token: mean of log pi_sampler - log pi_old"),
    Metric("mismatch/kl_k3", "nats", "k3 estimate of the same KL per token (never negative)"),
    Metric("mismatch/sampler_ppl", "perplexity", "exp of the mean negative log-prob of the sampled tokens under the sampler"),
    Metric("mismatch/trainer_ppl", "perplexity", "the same under the trainer's forward (pi_old)"),
    Metric("mismatch/weight_mean", "weight", "mean importance weight pi_old / pi_sampler as applied (off: the token weights)"),
    Metric("mismatch/weight_min", "weight", "smallest importance weight as applied"),
    Metric("mismatch/weight_max", "weight", "largest importance weight as applied (at most mismatch_cap when truncated)"),
    Metric("mismatch/ess", "fraction", "normalised effective sample size of the raw weights, (sum w)^2 / (n sum w^2), over tokens"),
    Metric("mismatch/truncated_frac", "fraction", "share of tokens whose weight was capped at mismatch_cap"),
    Metric("mismatch/masked_frac", "fraction", "share of tokens whose weight was outside [mismatch_low, mismatch_high] and set to 0"),
    Metric("mismatch/rejected_frac", "fraction", "share of responses rejected whole by mismatch_reject"),
    Metric("mismatch/bounded_frac", "fraction", "share of responses whose product weight's log hit +-20 (under- or overflow)"),
    # off-policy on purpose (recipe max_staleness > 0; postrl/train/staleness.py)
    Metric("async/staleness_mean", "updates", "updates made between drawing this step's samples and training on them, mean over the samples"),
    Metric("async/staleness_max", "updates", "the same, largest over the samples (at most max_staleness)"),
    Metric("async/queue_wait_s", "s", "seconds this step's samples waited, drawn, before the trainer took them"),
    Metric("async/sampler_idle_s", "s", "seconds the sampler thread waited for the weights that drew this step's samples (0 in order)"),
    Metric("async/trainer_idle_s", "s", "seconds the trainer waited for this step's samples (0 in order, where it draws them itself)"),
    # on-policy distillation (recipe distill_coef > 0; postrl/objectives/distill.py)
    Metric("distill/reverse_kl", "nats", "k1 estimate of KL(student || teacher) per token on the student's samples: mean of log pi_old - log pi_teacher, the term each token's advantage gets -distill_coef times"),
    Metric("distill/reverse_kl_k3", "nats", "k3 estimate of the same KL per token (never negative)"),
    Metric("distill/teacher_ppl", "perplexity", "exp of the mean negative log-prob of the student's sampled tokens under the teacher, after its prompt"),
    Metric("warm_start/samples", "responses", "samples the teacher drew for the warm start (logged with step 1; their tokens are in rollout/tokens_generated)"),
    Metric("warm_start/kept", "responses", "of them, those the verifier accepted: the warm start's targets"),
    Metric("warm_start/tokens", "tokens", "tokens the teacher generated for the warm start (counted in rollout/tokens_generated)"),
    Metric("warm_start/nll_first", "nats", "mean negative log-likelihood per token of those targets under the student, at the warm start's first step"),
    Metric("warm_start/nll_last", "nats", "the same at its last step (before that step's update)"),
    Metric("time/warm_start_s", "s", "seconds of the warm start: the teacher's sampling and the supervised steps"),
    Metric("value/clip_frac", "fraction", "critic terms where the clipped value error was larger"),
    # held-out evaluation (at step 0, every eval_every steps and at the last step)
    Metric("eval/accuracy", "fraction", "greedy pass@1 on the first eval_n held-out problems"),
    Metric("eval/mean_length", "tokens", "mean length of those greedy answers"),
    Metric("eval/sampled_accuracy", "fraction", "sampled pass@1 on those problems: the mean share of correct answers among eval_samples samples each (temperature 1)"),
    Metric("eval/truncated_frac", "fraction", "share of those sampled answers that hit max_new_tokens"),
    Metric("eval/distill_reverse_kl", "nats", "with a teacher: KL(student || teacher) per token (k1) on one student sample of each of those problems, the same prompts and seeds at every evaluation"),
    # reliability guards
    Metric("guard/skipped_steps", "steps", "cumulative steps whose update was skipped: loss or gradient not finite"),
    Metric("reward/errors", "samples", "reward values replaced by 0 this step (reward_errors: zero)"),
    # optimisation
    Metric("grad/norm", "norm", "policy gradient norm before clipping"),
    Metric("lr", "1", "policy learning rate"),
    # time and throughput
    Metric("time/generate_s", "s", "seconds spent generating this step"),
    Metric("time/score_s", "s", "seconds spent in reward functions this step"),
    Metric("time/reference_s", "s", "seconds spent on old-policy and reference log-probs"),
    Metric("time/train_s", "s", "seconds spent in forward, backward and optimizer steps"),
    Metric("time/sync_s", "s", "seconds copying the new weights into a sampler with its own copy (vLLM; 0 otherwise)"),
    Metric("time/eval_s", "s", "seconds spent on held-out evaluation this step (not in step_s)"),
    Metric("time/step_s", "s", "wall-clock seconds of the whole step"),
    Metric("throughput/tokens_per_s", "tokens/s", "generated tokens this step / step seconds"),
    Metric("memory/peak_gb", "GB", "peak memory: on a GPU, PyTorch's allocations during this step; on the CPU, the process's resident memory since it started"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}


def is_declared(name: str) -> bool:
    """True for a declared name or an instance of ``reward/<fn>/mean``."""
    if name in BY_NAME:
        return True
    parts = name.split("/")
    return len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean"


NON_NEGATIVE_UNITS = frozenset({"GB", "groups", "norm", "perplexity", "ratio", "responses",
                                "rounds", "s", "samples", "steps", "tokens", "tokens/s"})


def value_range(name: str) -> tuple[float, float]:
    """The values a metric can take, from its unit: [0, 1] for a fraction, [0, inf) for a
    count, a time or a ratio, unbounded otherwise (rewards, advantages, losses, nats)."""
    metric = BY_NAME.get(name)
    unit = metric.unit if metric else ""
    if unit == "fraction":
        return 0.0, 1.0
    return (0.0, math.inf) if unit in NON_NEGATIVE_UNITS else (-math.inf, math.inf)
