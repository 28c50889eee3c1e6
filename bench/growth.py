"""How postrl's step grows: step time and peak memory against response length and model size.

    python -m bench.growth [--lengths 64,256,1024] [--models 135m,360m,1.7b] [--steps 2]
                           [--lora-r R] [--gradient-checkpointing] [--out runs/growth]
                           [--gsm8k PATH]

Each cell is one child process (its peak RSS its own) training postrl's ``dr_grpo`` on GSM8K
questions, 4 prompts x 8 responses of at most LENGTH new tokens, fp32 (``bf16-master`` where
the CPU has fast bf16 matmuls), micro-batches of at most 8 rows and ``MICRO_BATCH_TOKENS``
tokens, for ``--steps`` steps, the first untimed. Models:
SmolLM2-135M-Instruct itself, and randomly initialised models of SmolLM2-360M's shape and of
SmolLM2-1.7B's (the published configs' widths, depths and heads). A random model almost never
samples its end-of-sequence token, so its responses run to the budget: each length's worst
case. The reward is :func:`text_hash`: every response a different score, so every row is
trained whatever the model writes. ``--lora-r R`` trains rank-R LoRA adapters on the attention
projections instead of all weights (``lora.r``): how a model whose full training state does not
fit in memory is trained here; ``--gradient-checkpointing`` recomputes each layer in the
backward (``gradient_checkpointing=true``). Either gives cells files and rows of their own.

A cell may use at most ``--memory-limit-gb`` (default 90% of this machine's memory); one that
needs more is recorded as not fitting. Each cell's result is written to OUT/MODEL-LENGTH.json
and a cell already there is not run again: the table resumes where it stopped. The table is
printed from those files.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

from bench.children import default_memory_limit_gb, peak_rss_mb, run_child
from bench.regimes import GSM8K, parse_regimes, task_spec
from bench.vs_trl import GROUP, MICRO_BATCH_TOKENS, PROMPTS

# the published SmolLM2 configs' shapes (hidden, intermediate, layers, heads, key-value heads)
SHAPES = {"360m": (960, 2560, 32, 15, 5), "1.7b": (2048, 8192, 24, 32, 32)}
MODELS = ("135m", *SHAPES)


def text_hash(prompts: list[str], completions: list[Any], **_: Any) -> list[float]:
    """A score in [0, 1) from the completion's text (CRC-32): a benchmark's reward that differs
    between any two different responses, so that no group is skipped; nothing to learn."""
    from postrl.rewards.math_answer import completion_text

    return [zlib.crc32(completion_text(c).encode()) / 2**32 for c in completions]


def model_dir(name: str, root: Path) -> str:
    """postrl's model spec for ``name``: the bundled SmolLM2-135M, or a directory holding a
    randomly initialised model of a SmolLM2 shape (made once, bf16 on disk) and SmolLM2's
    tokenizer."""
    if name == "135m":
        return "smollm2-135m-instruct"
    target = root / f"smollm2-{name}-random"
    if (target / "config.json").is_file():
        return str(target)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from postrl.models.loading import smollm2_dir

    hidden, intermediate, layers, heads, kv_heads = SHAPES[name]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    staging = Path(tempfile.mkdtemp(dir=root))
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, target)
    return str(target)


def run_cell(model: str, length: int, steps: int, gsm8k: Path, lora_r: int = 0,
             checkpointing: bool = False) -> dict:
    """One cell, in this process: ``steps`` postrl steps, the first untimed; rank-``lora_r``
    adapters trained instead of all weights where ``lora_r`` > 0; each layer recomputed in
    the backward with ``checkpointing``."""
    from postrl.config import load_config
    from postrl.models.precision import cpu_bf16_reason
    from postrl.train.trainer import Trainer

    regime = parse_regimes("gsm8k-256", gsm8k)[0]
    precision = "fp32" if cpu_bf16_reason() else "bf16-master"
    cfg = load_config(None, [
        f"model={model}", "recipe=dr_grpo", f"task={task_spec(regime)}",
        f"rewards=[{__file__}:text_hash]", f"prompts_per_step={PROMPTS}",
        f"group_size={GROUP}", f"max_new_tokens={length}", f"precision={precision}",
        f"micro_batch_tokens={MICRO_BATCH_TOKENS}", f"lora.r={lora_r}",
        f"gradient_checkpointing={str(checkpointing).lower()}",
        f"out={tempfile.mkdtemp()}/run", "quiet=true", f"steps={steps}"])
    trainer = Trainer(cfg)
    rows = [trainer.train_step() for _ in range(steps)][1:]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"precision": precision, "step_s": mean("time/step_s"),
            "generate_s": mean("time/generate_s"), "train_s": mean("time/train_s"),
            "tokens": mean("length/mean") * PROMPTS * GROUP,
            "zero_variance": mean("batch/zero_variance_frac"), "peak_rss_mb": peak_rss_mb()}


def spawn(model: str, length: int, args) -> dict:
    return run_child(["bench.growth", "--child", model, "--lengths", str(length), "--steps",
                      str(args.steps), "--gsm8k", args.gsm8k, "--lora-r", str(args.lora_r)]
                     + ["--gradient-checkpointing"] * args.gradient_checkpointing,
                     args.memory_limit_gb, f"{model} at {length} tokens")


def cell_name(model: str, length: int, lora_r: int, checkpointing: bool) -> str:
    """A cell's file stem: ``360m-256``; ``1.7b-64-lora16`` with adapters, ``-ckpt`` with
    the layers recomputed."""
    return (f"{model}-{length}" + (f"-lora{lora_r}" if lora_r else "")
            + ("-ckpt" if checkpointing else ""))


def print_table(results: dict[tuple[str, int], dict]) -> None:
    print(f"{'model':<18}{'length':>7}{'precision':>12}{'step s':>9}{'generate s':>12}"
          f"{'train s':>9}{'tokens/step':>13}{'ms/token':>10}{'peak RSS MB':>13}")
    for (model, length), r in results.items():
        if "failed" in r:
            print(f"{model:<18}{length:>7}  {r['failed']}")
            continue
        print(f"{model:<18}{length:>7}{r['precision']:>12}{r['step_s']:>9.2f}"
              f"{r['generate_s']:>12.2f}{r['train_s']:>9.2f}{r['tokens']:>13.0f}"
              f"{1e3 * r['step_s'] / r['tokens']:>10.2f}{r['peak_rss_mb']:>13.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256,1024", help="max new tokens per cell")
    parser.add_argument("--models", default=",".join(MODELS), help=", ".join(MODELS))
    parser.add_argument("--steps", type=int, default=2, help="steps per cell, the first untimed")
    parser.add_argument("--lora-r", type=int, default=0,
                        help="train rank-R LoRA adapters instead of all weights (lora.r)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each layer in the backward (gradient_checkpointing)")
    parser.add_argument("--out", default="runs/growth", help="one JSON file per cell")
    parser.add_argument("--gsm8k", default=str(GSM8K), help="GSM8K's train.jsonl")
    parser.add_argument("--memory-limit-gb", type=float, default=default_memory_limit_gb())
    parser.add_argument("--child", default=None, help="run one cell: a model spec")
    args = parser.parse_args()
    if args.child:
        result = run_cell(args.child, int(args.lengths), args.steps, Path(args.gsm8k),
                          args.lora_r, args.gradient_checkpointing)
        print("RESULT " + json.dumps(result), flush=True)
        return
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    parse_regimes("gsm8k-256", Path(args.gsm8k))  # a missing data file: before any run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for model in models:
        for length in (int(n) for n in args.lengths.split(",")):
            name = cell_name(model, length, args.lora_r, args.gradient_checkpointing)
            path = out / f"{name}.json"
            if not path.is_file():
                result = spawn(model_dir(model, out), length, args)
                path.write_text(json.dumps(result))
                print(f"  {name} done", flush=True)
            label = model + name.removeprefix(f"{model}-{length}").replace("-", " ")
            results[label, length] = json.loads(path.read_text())
    print_table(results)


if __name__ == "__main__":
    main()
