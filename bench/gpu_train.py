"""A few local training steps with ``device=cuda`` (or any device), and what they cost: step
time, generation and update time, generated tokens/s, peak device memory. Asserts that the
models really ran on that device. Used by ``bench/gpu_check.sh``; run from the repository's
root:

    python3 -m bench.gpu_train --model tiny --precision bf16 --steps 4 --out DIR
    python3 -m bench.gpu_train --model smollm2-shape ...   # SmolLM2-135M's shape, random weights

``smollm2-shape`` needs only SmolLM2's config and tokenizer (postrl's cache, or
``$POSTRL_CACHE``): the weights are drawn at random (seed 0) and saved beside ``--out``. The
reward varies within every group (even-length completions score 1), so every step updates.
One JSON line goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from postrl.config import load_config
from postrl.models.loading import smollm2_dir
from postrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

REWARD = f"{ROOT / 'tests' / 'train' / 'rewards_for_tests.py'}:length_parity"


def random_smollm2(target: Path) -> Path:
    """``target``, holding a SmolLM2-135M-shaped Llama with random weights (made once)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (target / "config.json").is_file():
        return target
    source = smollm2_dir()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-shape or a directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--recipe", default="grpo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = (str(random_smollm2(args.out.parent / "smollm2-shape"))  # shared by the runs
             if args.model == "smollm2-shape" else args.model)
    cfg = load_config(None, [
        f"recipe={args.recipe}", f"model={model}", "task=arithmetic", f"device={args.device}",
        f"precision={args.precision}", f"steps={args.steps}", f"prompts_per_step={args.prompts}",
        f"group_size={args.group_size}", f"max_new_tokens={args.max_new_tokens}",
        f"micro_batch_size={args.micro_batch_size}", "lr=1e-5", f"rewards=[{REWARD}]",
        "quiet=true", "overwrite=true", f"out={args.out / 'run'}"])
    started = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - started
    trainer.train()  # as `postrl train` does: metrics.jsonl, then the final policy saved
    rows = [json.loads(line) for line in (args.out / "run" / "metrics.jsonl").open()]
    device = trainer.device
    placed = {name: {p.device.type for p in module.parameters()}
              for name, module in (("policy", trainer.lm), ("critic", trainer.critic))
              if module is not None}
    assert all(kinds == {device.type} for kinds in placed.values()), placed
    if device.type == "cuda":
        assert torch.cuda.max_memory_allocated(device) > 0
    timed = rows[1:] or rows  # the first step pays for warm-up (allocator, kernels)
    mean = lambda key: statistics.fmean(r[key] for r in timed)  # noqa: E731
    print(json.dumps({
        "model": args.model, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": args.precision, "recipe": args.recipe, "steps": len(rows),
        "rows": args.prompts * args.group_size, "max_new_tokens": args.max_new_tokens,
        "parameters_m": round(sum(p.numel() for p in trainer.lm.parameters()) / 1e6, 1),
        "setup_s": round(setup_s, 2), "first_step_s": round(rows[0]["time/step_s"], 3),
        "step_s": round(mean("time/step_s"), 3), "generate_s": round(mean("time/generate_s"), 3),
        "train_s": round(mean("time/train_s"), 3),
        "tokens_per_step": round(statistics.fmean(
            b["rollout/tokens_generated"] - a["rollout/tokens_generated"]
            for a, b in zip(rows, rows[1:], strict=False)) if len(rows) > 1
            else rows[0]["rollout/tokens_generated"]),
        "tokens_per_s": round(mean("throughput/tokens_per_s"), 1),
        "peak_memory_gb": round(max(r["memory/peak_gb"] for r in rows), 3),
        "loss_finite": all(r.get("loss/total", 0.0) == r.get("loss/total", 0.0) for r in rows),
        "grad_norm": rows[-1].get("grad/norm"),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
