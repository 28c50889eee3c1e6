"""``postrl diagnose RUN_DIR``: turn a run's metrics into findings with advice.

Each :class:`Finding` cites the metric, a value and the step range it is about, says what
was seen and what to try. The checks and their thresholds (module constants below):

- ``zero_variance``: mean ``batch/zero_variance_frac`` ≥ :data:`ZERO_VARIANCE_HIGH`.
- ``flat_reward``: ``reward/mean`` moves by at most :data:`FLAT_REWARD_RANGE` while every
  ``grad/norm`` ≤ :data:`ZERO_GRAD_NORM` or every group is zero-variance; the message says why.
- ``length_drift``: relative change (first vs last :data:`TREND_WINDOW` of the steps) of
  ``length/incorrect_mean`` and ``length/correct_mean`` differing by ≥ :data:`LENGTH_DRIFT_GAP`.
  A warning under a length or std normaliser (Dr. GRPO, Liu et al. 2025 §3.1), else info.
- ``ratio_heavy_tail``: ``ratio/max`` ≥ :data:`RATIO_MAX_HIGH`; ``clip_spike``: a step's
  ``clip/low_frac + clip/high_frac`` ≥ :data:`CLIP_SPIKE_MIN` and ≥ :data:`CLIP_SPIKE_FACTOR`
  × the run's median; ``logratio_spread``: ``ratio/token_logratio_std`` ≥
  :data:`TOKEN_LOGRATIO_STD_HIGH`.
- ``entropy_collapse``: ``entropy/mean`` falls by a factor ≥ :data:`ENTROPY_COLLAPSE_FACTOR`.
- ``truncation``: ``length/truncated_frac`` ≥ :data:`TRUNCATION_HIGH` (run or late mean).
- ``sampler_mismatch``: a step's ``mismatch/kl_k3`` ≥ :data:`MISMATCH_KL_HIGH` or its
  ``mismatch/ess`` ≤ :data:`MISMATCH_ESS_LOW`: the sampler and the trainer disagree.

Trend checks (length drift, entropy) need :data:`MIN_TREND_STEPS` steps with values.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from postrl.experiments.report import load_run
from postrl.experiments.stats import finite
from postrl.telemetry.jsonl import jsonable

ZERO_VARIANCE_HIGH = 0.5  # half the groups teach nothing: worth dynamic sampling
FLAT_REWARD_RANGE = 1e-6  # max - min of reward/mean over the run
ZERO_GRAD_NORM = 1e-8  # a gradient norm this small is no update at all
MIN_TREND_STEPS = 5
TREND_WINDOW = 0.25  # share of the steps (at least one) averaged at each end of a trend
LENGTH_DRIFT_GAP = 0.25  # 25 points between the relative length changes of the two classes
RATIO_MAX_HIGH = 5.0  # an importance ratio 5x the sampling probability
CLIP_SPIKE_MIN = 0.05  # a spike clips at least 5% of the terms ...
CLIP_SPIKE_FACTOR = 5.0  # ... and 5x the run's median clipped fraction
TOKEN_LOGRATIO_STD_HIGH = 0.2  # ≈ log 1.2: the spread alone exceeds PPO's ±0.2 clip range
ENTROPY_COLLAPSE_FACTOR = 4.0
TRUNCATION_HIGH = 0.2
MISMATCH_KL_HIGH = 1e-3  # nats a token: over a 500-token response, a log-weight of about 0.5
MISMATCH_ESS_LOW = 0.8  # a fifth of the sample's weight lost to unequal importance weights
LENGTH_NORMALISED = ("seq_mean_token_mean",)  # aggregations dividing by each response's length
STD_SCALED = ("group", "batch")  # adv_scale values dividing by a reward std


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what (kind, metric, value, steps), how bad, and what to do."""

    kind: str
    severity: str  # "info", "warning" or "error"
    metric: str
    value: float
    steps: tuple[int, int]
    message: str
    advice: str

    def to_dict(self) -> dict[str, Any]:
        return jsonable(asdict(self))


@dataclass(frozen=True)
class View:
    """A run's metrics and recipe, as the checks read them."""

    records: list[dict[str, Any]]
    recipe: dict[str, Any]

    def points(self, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` for every step where ``metric`` is a finite number."""
        return [(int(r.get("step", i + 1)), v) for i, r in enumerate(self.records)
                for v in finite([r.get(metric)])]

    def values(self, metric: str) -> list[float]:
        return [v for _, v in self.points(metric)]

    def span(self, metric: str) -> tuple[int, int]:
        steps = [s for s, _ in self.points(metric)] or [0]
        return steps[0], steps[-1]


def _ends(values: list[float]) -> tuple[float, float]:
    """Means of the first and last :data:`TREND_WINDOW` of ``values``."""
    width = max(1, round(len(values) * TREND_WINDOW))
    return statistics.fmean(values[:width]), statistics.fmean(values[-width:])


def _mean_accuracy(view: View) -> float:
    values = view.values("accuracy/mean") or view.values("reward/mean")
    return statistics.fmean(values) if values else float("nan")


def check_zero_variance(view: View) -> list[Finding]:
    points = view.points("batch/zero_variance_frac")
    mean = statistics.fmean(v for _, v in points) if points else 0.0
    if mean < ZERO_VARIANCE_HIGH:
        return []
    high = [s for s, v in points if v >= ZERO_VARIANCE_HIGH]
    easy = _mean_accuracy(view) >= 0.5
    which = "too easy (most groups all correct)" if easy else "too hard (most groups all wrong)"
    if view.recipe.get("dynamic_sampling"):
        wasted = (view.values("rollout/tokens_wasted") or [0.0])[-1]
        total = (view.values("rollout/tokens_generated") or [1.0])[-1] or 1.0
        advice = (f"dynamic sampling is on and spent {wasted / total:.0%} of generated tokens on "
                  f"dropped groups; the prompts look {which}: choose prompts of matched difficulty")
    else:
        advice = ("turn on dynamic sampling (DAPO §3.2: recipe_options.dynamic_sampling=true) or "
                  f"use prompts of matched difficulty; these look {which}")
    return [Finding("zero_variance", "warning", "batch/zero_variance_frac", mean,
                    (high[0], high[-1]),
                    f"{mean:.0%} of groups had all-equal rewards on average, so their "
                    "group-relative advantages were 0 and they gave no gradient", advice)]


def check_flat_reward(view: View) -> list[Finding]:
    rewards, grads = view.values("reward/mean"), view.values("grad/norm")
    zero_var = view.values("batch/zero_variance_frac")
    if len(rewards) < 2 or max(rewards) - min(rewards) > FLAT_REWARD_RANGE:
        return []
    all_zero_var = bool(zero_var) and min(zero_var) >= 1.0
    zero_grad = bool(grads) and max(grads) <= ZERO_GRAD_NORM
    if not (all_zero_var or zero_grad):
        return []
    if all_zero_var:
        level = "no response was ever correct" if _mean_accuracy(view) < 0.5 else \
            "every response was correct"
        why = (f"every group's responses got the same reward ({level}), so every group-relative "
               "advantage is 0 and the policy gradient is 0 (only KL or entropy terms can move "
               "the policy)")
        advice = ("read samples.jsonl: check the verifier accepts the answer format, that "
                  "max_new_tokens leaves room for an answer (length/truncated_frac), and that the "
                  "task's difficulty fits the model; more samples per prompt (group_size) help")
    else:
        why = ("groups had reward variance but the gradient norm is 0: every response may be "
               "masked (overlong filtering of truncated responses) or no parameter is trainable")
        advice = "check batch/overlong_filtered, length/truncated_frac, lr and the LoRA targets"
    return [Finding("flat_reward", "error", "reward/mean", rewards[-1], view.span("reward/mean"),
                    f"reward/mean stayed at {rewards[-1]:.3g}: {why}", advice)]


def check_length_drift(view: View) -> list[Finding]:
    correct, incorrect = view.values("length/correct_mean"), view.values("length/incorrect_mean")
    if min(len(correct), len(incorrect)) < MIN_TREND_STEPS:
        return []
    changes = [(end - start) / max(start, 1.0) for start, end in (_ends(correct),
                                                                 _ends(incorrect))]
    gap = changes[1] - changes[0]
    if abs(gap) < LENGTH_DRIFT_GAP:
        return []
    agg, scale = view.recipe.get("aggregation"), view.recipe.get("adv_scale")
    normalised = agg in LENGTH_NORMALISED or scale in STD_SCALED
    message = (f"incorrect responses changed length by {changes[1]:+.0%}, correct ones by "
               f"{changes[0]:+.0%} (aggregation={agg}, adv_scale={scale})")
    if normalised:
        advice = ("check normalisation before calling this better reasoning: Dr. GRPO (Liu et al. "
                  "2025 §3.1) shows per-response length normalisation lets wrong answers grow and "
                  "std scaling reweights questions; rerun with aggregation=seq_mean_token_sum_norm "
                  "and adv_scale=none (recipe dr_grpo) and compare")
    else:
        advice = ("the recipe has neither a length nor a std normaliser, so that bias is ruled "
                  "out; read the samples to see what the lengths mean")
    first, _ = view.span("length/correct_mean")
    _, last = view.span("length/incorrect_mean")
    return [Finding("length_drift", "warning" if normalised else "info", "length/incorrect_mean",
                    gap, (first, last), message, advice)]


def _ratio_advice(view: View) -> str:
    if view.recipe.get("ratio") in ("sequence", "sequence_token", "hybrid"):
        return ("the recipe already corrects at sequence level; fewer updates per batch "
                "(epochs, minibatches) or a lower lr keep the policy closer to the sampler")
    return ("use a sequence-level or hybrid importance ratio (GSPO: ratio=sequence; DHPO: "
            "ratio=hybrid), or fewer updates per batch")


def check_ratios(view: View) -> list[Finding]:
    findings, advice = [], _ratio_advice(view)
    big = [(s, v) for s, v in view.points("ratio/max") if v >= RATIO_MAX_HIGH]
    if big:
        findings.append(Finding("ratio_heavy_tail", "warning", "ratio/max",
                                max(v for _, v in big), (big[0][0], big[-1][0]),
                                f"importance ratios reached {max(v for _, v in big):.3g} on "
                                f"{len(big)} step(s): heavy-tailed token weights", advice))
    low, high = dict(view.points("clip/low_frac")), dict(view.points("clip/high_frac"))
    clipped = [(s, low.get(s, 0.0) + high.get(s, 0.0)) for s in sorted(set(low) | set(high))]
    if clipped:
        median = statistics.median(v for _, v in clipped)
        spikes = [(s, v) for s, v in clipped
                  if v >= CLIP_SPIKE_MIN and v >= CLIP_SPIKE_FACTOR * median]
        if spikes:
            top = max(v for _, v in spikes)
            findings.append(Finding("clip_spike", "warning", "clip/low_frac+clip/high_frac", top,
                                    (spikes[0][0], spikes[-1][0]),
                                    f"clipped fraction spiked to {top:.1%} on {len(spikes)} "
                                    f"step(s) (run median {median:.1%})", advice))
    wide = [(s, v) for s, v in view.points("ratio/token_logratio_std")
            if v >= TOKEN_LOGRATIO_STD_HIGH]
    if wide:
        top = max(v for _, v in wide)
        findings.append(Finding("logratio_spread", "warning", "ratio/token_logratio_std", top,
                                (wide[0][0], wide[-1][0]),
                                f"token log-ratios within a response spread by up to {top:.3g} "
                                f"nats on {len(wide)} step(s)", advice))
    return findings


def check_entropy(view: View) -> list[Finding]:
    points = view.points("entropy/mean")
    if len(points) < MIN_TREND_STEPS:
        return []
    start, end = _ends([v for _, v in points])
    if start <= 0 or start < ENTROPY_COLLAPSE_FACTOR * max(end, 0.0):
        return []
    below = next(s for s, v in points if v <= start / ENTROPY_COLLAPSE_FACTOR)
    clip_low, clip_high = view.recipe.get("clip_low"), view.recipe.get("clip_high")
    if clip_low is not None and clip_high is not None and clip_high > clip_low:
        advice = (f"clip-higher is already on (eps_high={clip_high}); raise it further or add "
                  "an entropy bonus (recipe_options.entropy_coef)")
    else:
        advice = ("use clip-higher (DAPO §3.1: recipe_options.clip_high=0.28) so that unlikely "
                  "tokens can still gain probability")
    return [Finding("entropy_collapse", "warning", "entropy/mean", end, (points[0][0], below),
                    f"entropy fell from {start:.3g} to {end:.3g} nats, by a factor "
                    f"{start / end if end > 0 else float('inf'):.3g}", advice)]


def check_truncation(view: View) -> list[Finding]:
    values = view.values("length/truncated_frac")
    if not values:
        return []
    value = max(statistics.fmean(values), _ends(values)[1])
    if value < TRUNCATION_HIGH:
        return []
    if view.recipe.get("overlong_filter") or view.recipe.get("overlong_penalty"):
        advice = "overlong handling is already on; raise max_new_tokens if answers need the room"
    else:
        advice = ("handle overlong responses (DAPO §3.4: recipe_options.overlong_filter=true or "
                  "overlong_penalty=true) or raise max_new_tokens")
    high = [s for s, v in view.points("length/truncated_frac") if v >= TRUNCATION_HIGH]
    return [Finding("truncation", "warning", "length/truncated_frac", value, (high[0], high[-1]),
                    f"{value:.0%} of responses hit max_new_tokens", advice)]


def check_mismatch(view: View) -> list[Finding]:
    kl, ess = view.points("mismatch/kl_k3"), view.points("mismatch/ess")
    high = sorted({s for s, v in kl if v >= MISMATCH_KL_HIGH} |
                  {s for s, v in ess if v <= MISMATCH_ESS_LOW})
    if not high:
        return []
    worst = max(v for _, v in kl) if kl else float("nan")
    lowest = min(v for _, v in ess) if ess else float("nan")
    if view.recipe.get("mismatch_weight", "none") == "none":
        advice = ("correct it: recipe_options.mismatch_weight=token truncates token importance "
                  "weights pi_old/pi_sampler at mismatch_cap=2 (TIS, Yao et al. 2025); "
                  "mismatch_mode=mask drops outliers instead (IcePop); and look for its source "
                  "(sampler_precision, a stale sampler)")
    else:
        shares = [statistics.fmean(view.values(m) or [0.0])
                  for m in ("mismatch/truncated_frac", "mismatch/masked_frac")]
        advice = (f"the correction is on ({view.recipe['mismatch_weight']}, "
                  f"{view.recipe.get('mismatch_mode')}; {shares[0]:.1%} of tokens truncated, "
                  f"{shares[1]:.1%} masked on average); shrink the gap at its source: the same "
                  "precision for sampler and trainer, fresher sampler weights")
    return [Finding("sampler_mismatch", "warning", "mismatch/kl_k3", worst, (high[0], high[-1]),
                    f"the sampler and the trainer disagree: mismatch KL (k3) up to {worst:.2g} "
                    f"nats a token, effective sample size down to {lowest:.2f}", advice)]


CHECKS: tuple[Callable[[View], list[Finding]], ...] = (
    check_flat_reward, check_zero_variance, check_length_drift, check_ratios, check_entropy,
    check_truncation, check_mismatch,
)


def diagnose(run_dir: Path | str) -> list[Finding]:
    """Every finding of every check on the run in ``run_dir`` (DataError if unreadable)."""
    run = load_run(Path(run_dir))
    view = View(run.records, dict(run.config.get("resolved_recipe") or {}))
    return [finding for check in CHECKS for finding in check(view)]


def format_finding(finding: Finding) -> str:
    """Three lines of text for a person."""
    first, last = finding.steps
    return (f"[{finding.severity}] {finding.kind}: {finding.metric} = {finding.value:.4g} "
            f"(steps {first}-{last})\n  {finding.message}\n  advice: {finding.advice}")


def add_diagnose_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``postrl diagnose``."""
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory")
    parser.add_argument("--json", action="store_true", help="print the findings as a JSON list")


def run_diagnose(args: argparse.Namespace) -> int:
    """``postrl diagnose``: print the findings; exit status 0 whether or not there are any."""
    findings = diagnose(args.run_dir)
    if args.json:
        print(json.dumps([finding.to_dict() for finding in findings], indent=2))
    elif not findings:
        print(f"{args.run_dir}: no findings")
    else:
        print(f"{args.run_dir}: {len(findings)} finding(s)")
        print("\n".join(format_finding(finding) for finding in findings))
    return 0
