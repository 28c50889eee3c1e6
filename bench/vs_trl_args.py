"""``bench/vs_trl.py``'s command line: its options, and the frameworks that recompute."""

from __future__ import annotations

import argparse

from bench.children import default_memory_limit_gb
from bench.regimes import GSM8K, REGIMES


def parse_arguments(description: str, micro_batch_tokens: int) -> argparse.Namespace:
    """The options of ``vs_trl.py`` (``micro_batch_tokens``: postrl's cap, for the help)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--regimes", default=",".join(REGIMES),
                        help=f"comma-separated, of {', '.join(REGIMES)} (bench/regimes.py)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per child (default: the regime's, "
                             + ", ".join(f"{r.name} {r.steps}" for r in REGIMES.values()) + ")")
    parser.add_argument("--rounds", type=int, default=2, help="A/B alternations per setting")
    parser.add_argument("--precisions", default=None,
                        help="settings to run (default fp32,bf16; fp32 alone on a CPU without "
                             "fast bf16 matmuls, where bf16 is no one's fastest setting)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="postrl's rows per forward/backward (default: 16 in fp32, 32 in "
                             f"bf16; and at most {micro_batch_tokens:,} tokens)")
    parser.add_argument("--trl-micro-batch-size", type=int, default=None,
                        help="TRL's rows per forward/backward, gradients accumulated over a "
                             "step's 32 (default: the regime's, " + ", ".join(
                                 f"{r.name} {r.trl_micro_batch}" for r in REGIMES.values()) + ")")
    parser.add_argument("--postrl-bf16", default="bf16-master", choices=("bf16", "bf16-master"),
                        help="postrl's precision in the bf16 setting (TRL autocasts)")
    parser.add_argument("--postrl-compile", action="store_true",
                        help="postrl with torch_compile=true (compiled in its untimed first step)")
    parser.add_argument("--gradient-checkpointing", default="",
                        help="comma-separated frameworks that recompute each decoder layer's "
                             "activations in the backward: postrl, trl (TRL's default; off "
                             "here, where both run faster without)")
    parser.add_argument("--postrl-return-freed-memory", action="store_true",
                        help="postrl with reuse_freed_memory=false: tensors of 1 MiB and more "
                             "go back to the kernel when freed (less memory, slower)")
    parser.add_argument("--gsm8k", default=str(GSM8K), help="GSM8K's train.jsonl")
    parser.add_argument("--memory-limit-gb", type=float, default=default_memory_limit_gb(),
                        help="most memory a child may use (default: 90%% of this machine's)")
    parser.add_argument("--child", choices=("postrl", "trl"))
    parser.add_argument("--seed", type=int, default=0,
                        help="a child's seed: its prompts' order and its sampling (round r: r)")
    return parser.parse_args()


def checkpointed(args) -> set[str]:
    """The frameworks ``--gradient-checkpointing`` names; SystemExit for another name."""
    names = {n for n in args.gradient_checkpointing.split(",") if n}
    if names - {"postrl", "trl"}:
        raise SystemExit(f"--gradient-checkpointing {args.gradient_checkpointing}: "
                         "frameworks are postrl and trl")
    return names
