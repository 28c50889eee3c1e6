"""This machine's matmul peak (fp32, bf16) and how close postrl's phases get to it.

    python -m bench.roofline [--model smollm2-135m-instruct] [--skip-postrl]

Peak: the best of several large square matmuls per dtype (three sizes, ten calls each). On a
CPU without fast bf16 matmuls (AVX2: no AVX-512 or AMX) only fp32 is measured.
Training phase: model FLOPs of one forward+backward on bench/vs_trl.py's batch (4 prompts x 8
completions), counted as 6 * parameters * tokens of the rows that carry a gradient (the
others run no forward; each prompt once per group), divided by the measured time; also set
against the matmul rate at the model's own shapes (every linear layer's forward and two
backward matmuls at one micro-batch's token count, the LM head at one chunk's, each timed
alone), the most the training phase could reach if it were nothing but its matmuls. In fp32
and ``bf16-master`` the update reads the sampler's recorded forward by default
(``reuse_sampler_forward``, ``postrl/accel/recorded.py``) and multiplies only in its
backward (4 * parameters * tokens): the FLOP/s above come from a run that multiplies its forward
(``reuse_sampler_forward=false``), and a second run, the default, is reported beside it with
the FLOPs it performs. Generation: tokens per second, and time per decode step against the
time to read the sampling weights once at the measured memory-read rate and against the
arithmetic of a decode step of the whole batch at the matmul peak (a decode step reads every
weight once: with few rows that read is the bound; with 32 rows in fp32 the matmuls'
arithmetic takes longer than the read).
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import torch

from bench.peaks import fastest, machine_limits
from bench.regimes import trained_tokens
from bench.vs_trl import MICRO_BATCH
from postrl.models.precision import cpu_bf16_reason
from postrl.train.setup import records_forward


def shapes_rate(model, dtype: torch.dtype, tokens: int, head_tokens: int,
                repeats: int = 3) -> float:
    """GFLOP/s of the training phase's own matmuls: for every linear layer of ``model`` (the
    LM head at ``head_tokens`` rows, the others at ``tokens``), the forward ``X W^T`` and the
    backward ``dY W`` and ``dY^T X``, each the fastest of ``repeats``, weighted by its FLOPs."""
    head = model.get_output_embeddings()
    counts: dict[tuple[int, int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            rows = head_tokens if module is head else tokens
            shape = (rows, *module.weight.shape)
            counts[shape] = counts.get(shape, 0) + 1
    flops = seconds = 0.0
    for (rows, out_features, in_features), count in counts.items():
        x = torch.randn(rows, in_features, dtype=dtype)
        weight = torch.randn(out_features, in_features, dtype=dtype)
        grad = torch.randn(rows, out_features, dtype=dtype)
        for left, right in ((x, weight.T), (grad, weight), (grad.T, x)):
            seconds += count * fastest(partial(torch.matmul, left, right), repeats)
            flops += count * 2.0 * rows * out_features * in_features
    return flops / seconds / 1e9


def training_flops(model, tokens: int, per_weight: float = 6.0) -> float:
    """6 N T: forward 2NT and backward 4NT over the weights (attention scores, a few per
    cent at these lengths, are left out, so the achieved FLOP/s is slightly understated);
    ``per_weight=4`` for a backward alone."""
    params = sum(p.numel() for p in model.parameters())
    return per_weight * params * tokens


def measure_postrl(model_spec: str, precision: str, reuse_forward: bool = False) -> dict:
    from postrl.config import load_config
    from postrl.models.logprobs import HEAD_CHUNK_TOKENS
    from postrl.models.precision import sampling_dtype
    from postrl.train.trainer import Trainer

    cfg = load_config(None, [f"model={model_spec}", "recipe=dr_grpo", "steps=3", "quiet=true",
                             "prompts_per_step=4", "group_size=8", "max_new_tokens=64",
                             "task=arithmetic",
                             f"micro_batch_size={MICRO_BATCH[precision]}",  # as bench/vs_trl.py
                             "out=/tmp/postrl-roofline", "overwrite=true",
                             f"precision={precision}",
                             f"reuse_sampler_forward={str(reuse_forward).lower()}"])
    trainer = Trainer(cfg)
    recorded = []  # whether each step's sampler recorded its forward for the update
    generate = trainer.engine.generate

    def noting_records(*args, **kwargs):
        rollouts = generate(*args, **kwargs)
        recorded.append(rollouts.kept_rows is not None)
        return rollouts

    trainer.engine.generate = noting_records
    batches = []  # each step's batch, as the update gets it (its record freed once stale)
    update = trainer.phases.update
    trainer.phases.update = lambda batch: batches.append(batch) or update(batch)
    rows = []
    for _ in range(cfg.steps):
        rows.append(trainer.train_step())
    last = rows[-1]
    tokens = last["rollout/tokens_generated"] - rows[-2]["rollout/tokens_generated"]
    trained_rows, trained = trained_tokens(trainer, batches[-1])
    if not trained_rows:
        raise SystemExit(f"{model_spec}: every group of the last step had equal rewards, so its "
                         "update trained no row: no training rate to measure")
    micro_batches = max(-(-trained_rows // cfg.micro_batch_size), 1)
    # what every decode step reads: the sampling weights
    weight_bytes = sum(p.numel() for p in trainer.lm.parameters()) * sampling_dtype(
        precision, trainer.lm.dtype).itemsize
    return {"train_gflops": training_flops(trainer.lm, trained) / last["time/train_s"] / 1e9,
            "backward_gflops": (training_flops(trainer.lm, trained, per_weight=4.0)
                                / last["time/train_s"] / 1e9),
            "generate_tokens_per_s": tokens / last["time/generate_s"],
            # one forward per token of the longest response (prefill and scoring included)
            "generate_ms_per_step": 1e3 * last["time/generate_s"] / max(last["length/max"], 1),
            "weight_mb": weight_bytes / 1e6,
            # a decode step of all the batch's rows: 2 FLOPs per weight per row
            "decode_gflop": 2.0 * sum(p.numel() for p in trainer.lm.parameters())
            * cfg.prompts_per_step * cfg.group_size / 1e9,
            # one micro-batch's rows, as its linear layers see them
            "tokens_per_micro_batch": trained / micro_batches,
            # the LM head sees chunks of HEAD_CHUNK_TOKENS tokens
            "head_tokens_per_micro_batch": min(trained / micro_batches, HEAD_CHUNK_TOKENS),
            "model": trainer.lm, "config": cfg, "recorded": recorded[-1],
            "train_s": last["time/train_s"], "generate_s": last["time/generate_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--skip-postrl", action="store_true")
    args = parser.parse_args()
    slow_bf16 = cpu_bf16_reason()
    if slow_bf16:  # a 3,072-wide bf16 matmul would take minutes, and no one trains in bf16 here
        print(f"bf16 skipped: {slow_bf16}")
    peaks, bandwidth = machine_limits(["fp32"] if slow_bf16 else ["fp32", "bf16"])
    if args.skip_postrl:
        return
    for precision in ("fp32",) if slow_bf16 else ("fp32", "bf16", "bf16-master"):
        result = measure_postrl(args.model, precision)
        peak = "fp32" if precision == "fp32" else "bf16"
        share = result["train_gflops"] / peaks[peak]
        at_shapes = shapes_rate(result["model"], torch.float32 if peak == "fp32" else
                                torch.bfloat16, round(result["tokens_per_micro_batch"]),
                                round(result["head_tokens_per_micro_batch"]))
        print(f"postrl {precision}: training {result['train_gflops']:.0f} GFLOP/s "
              f"({share:.0%} of the {peak} peak, {result['train_s']:.1f} s; its matmuls alone "
              f"run at {at_shapes:.0f} GFLOP/s at the model's shapes, "
              f"{at_shapes / peaks[peak]:.0%} of the peak; training reaches "
              f"{result['train_gflops'] / at_shapes:.0%} of that), generation "
              f"{result['generate_tokens_per_s']:.0f} tokens/s ({result['generate_s']:.1f} s, "
              f"{result['generate_ms_per_step']:.0f} ms per decode step, against "
              f"{result['weight_mb'] / bandwidth:.0f} ms to read its "
              f"{result['weight_mb']:.0f} MB of weights once and "
              f"{result['decode_gflop'] / peaks[peak] * 1e3:.0f} ms for a full batch's "
              f"arithmetic at the {peak} peak)")
        if records_forward(dataclasses.replace(result["config"], reuse_sampler_forward=True)):
            reusing = measure_postrl(args.model, precision, reuse_forward=True)
            if not reusing["recorded"]:  # the engine's own conditions (memory, FLOPs per byte)
                print(f"postrl {precision}: the sampler records no forward for this model")
                continue
            print(f"postrl {precision} reading the sampler's forward (reuse_sampler_forward, "
                  f"the default): training {reusing['train_s']:.1f} s, "
                  f"{reusing['train_s'] / result['train_s']:.2f}x the time above (another "
                  f"batch); its backward's multiplications at "
                  f"{reusing['backward_gflops']:.0f} GFLOP/s "
                  f"({reusing['backward_gflops'] / peaks[peak]:.0%} of the {peak} peak; "
                  f"{reusing['train_gflops']:.0f} GFLOP/s counting the forward the sampler "
                  f"ran), generation {reusing['generate_s']:.1f} s (recording)")


if __name__ == "__main__":
    main()
