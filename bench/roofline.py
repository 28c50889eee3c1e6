"""This machine's matmul peak (fp32, bf16) and how close postrl's phases get to it.

    python bench/roofline.py [--model smollm2-135m-instruct] [--skip-postrl]

Peak: the best of several large square matmuls per dtype. Training phase: model FLOPs of one
forward+backward on bench/vs_trl.py's batch (4 prompts x 8 completions), counted as 6 * parameters
* tokens (each prompt once per group), divided by the measured time. Generation: tokens per
second.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of the fastest of ``repeats`` ``size x size`` matmuls."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def training_flops(model, tokens: int) -> float:
    """6 N T: forward 2NT and backward 4NT over the weights (attention scores, a few per
    cent at these lengths, are left out, so the achieved FLOP/s is slightly understated)."""
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params * tokens


def measure_postrl(model_spec: str, precision: str) -> dict[str, float]:
    from postrl.config import load_config
    from postrl.train.trainer import Trainer

    cfg = load_config(None, [f"model={model_spec}", "recipe=dr_grpo", "steps=3", "quiet=true",
                             "prompts_per_step=4", "group_size=8", "max_new_tokens=64",
                             "task=arithmetic", "micro_batch_size=16",  # as bench/vs_trl.py
                             "out=/tmp/postrl-roofline", "overwrite=true",
                             f"precision={precision}"])
    trainer = Trainer(cfg)
    rows = []
    for _ in range(cfg.steps):
        rows.append(trainer.train_step())
    last = rows[-1]
    tokens = last["rollout/tokens_generated"] - rows[-2]["rollout/tokens_generated"]
    prompt_tokens = sum(len(p) for p in trainer.prompt_cache.values()) / len(trainer.prompt_cache)
    # rows of a prompt share its forward (postrl/models/logprobs.py): each prompt counts once
    # per group, the least work that can give the gradient (a prompt whose rows fall into
    # several micro-batches runs once in each, so the achieved FLOP/s is a lower bound)
    trained = tokens + prompt_tokens * cfg.prompts_per_step
    return {"train_gflops": training_flops(trainer.lm, trained) / last["time/train_s"] / 1e9,
            "generate_tokens_per_s": tokens / last["time/generate_s"],
            "train_s": last["time/train_s"], "generate_s": last["time/generate_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--skip-postrl", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    peaks = {name: matmul_peak(dtype) for name, dtype in (("fp32", torch.float32),
                                                           ("bf16", torch.bfloat16))}
    for name, value in peaks.items():
        print(f"matmul peak {name}: {value:.0f} GFLOP/s")
    if args.skip_postrl:
        return
    for precision in ("fp32", "bf16", "bf16-master"):
        result = measure_postrl(args.model, precision)
        peak = "fp32" if precision == "fp32" else "bf16"
        share = result["train_gflops"] / peaks[peak]
        print(f"postrl {precision}: training {result['train_gflops']:.0f} GFLOP/s "
              f"({share:.0%} of the {peak} peak, {result['train_s']:.1f} s), generation "
              f"{result['generate_tokens_per_s']:.0f} tokens/s ({result['generate_s']:.1f} s)")


if __name__ == "__main__":
    main()
