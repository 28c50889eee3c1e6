"""The lean sampler's decode attention in float32 as two batched matmuls around a softmax
(from ``MATMUL_ATTENTION_FROM_ROWS`` running rows), against PyTorch's fused attention kernel
at every row count (what it ran before), alternated in one process.

    python bench/decode_attention_ab.py [--reps 8] [--from-rows N]

``bench/vs_trl.py``'s first prompts (SmolLM2, fp32, 4 prompts x 8, 64 new tokens): one
``generate`` samples their responses, then the lean decoder is fed those same tokens each
way ``reps`` times (ABBA order), dropping finished rows as the engine does; medians over the
runs but the first two. (Sampling each way instead would compare other tokens: the two ways
round differently, and one draw moved across a token's boundary changes the rest of its
response.) ``--from-rows`` sets the row count from which the matmuls run (default: the
engine's). The bench's prompts are shorter than the 64 tokens from which the engine shares
a prompt's cache columns among its samples; that path is not changed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from postrl.accel import lean
from postrl.rollout.hf import COMPACT_FRACTION, left_padded


def fused(q, keys, values, mask):
    """The attention of each row's own columns as before: PyTorch's fused kernel."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def decode(weights, prompts, group: int, max_new: int, responses, lengths, pad_id: int) -> None:
    """Prefill, then feed each row its response's tokens, finished rows dropped."""
    ids, attention, positions = left_padded(prompts, pad_id)
    decoder = lean.LeanDecoder(weights, ids, attention, positions, group, max_new)
    rows = torch.arange(len(responses))
    next_position = positions[:, -1].repeat_interleave(group) + 1
    for step in range(int(lengths.max()) - 1):
        alive = lengths[rows] > step + 1
        if (~alive).sum() >= COMPACT_FRACTION * len(alive):
            keep = alive.nonzero().flatten()
            decoder.select(keep)
            rows, next_position = rows[keep], next_position[keep]
        decoder.step(responses[rows, step], next_position + step)


def main() -> None:
    from ab import alternating, first_prompt_ids  # bench/, this script's directory
    from vs_trl import GROUP, MAX_NEW, postrl_config

    from postrl.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8, help="runs of each way")
    parser.add_argument("--from-rows", type=int, default=lean.MATMUL_ATTENTION_FROM_ROWS,
                        help="running rows from which the matmuls run")
    args = parser.parse_args()
    lean.MATMUL_ATTENTION_FROM_ROWS = args.from_rows
    trainer = Trainer(postrl_config(1, seed=0))
    engine = trainer.engine
    prompts = first_prompt_ids(trainer)
    rollouts = engine.generate(prompts, GROUP, trainer.sampling, seed=0)
    weights = lean.LeanWeights.of(trainer.lm, torch.float32, len(rollouts.lengths))
    matmuls = lean._attend_rows
    times: dict[bool, list[float]] = {True: [], False: []}
    for way in alternating(args.reps):
        lean._attend_rows = matmuls if way else fused
        start = time.perf_counter()
        decode(weights, prompts, GROUP, MAX_NEW, rollouts.response_ids, rollouts.lengths,
               engine.pad_id)
        times[way].append(time.perf_counter() - start)
    before, after = (statistics.median(times[way][2:]) for way in (False, True))
    print(f"decoding {int(rollouts.lengths.sum())} tokens of 32 responses (longest "
          f"{int(rollouts.lengths.max())}) after {max(len(p) for p in prompts)} prompt tokens, "
          f"matmuls from {args.from_rows} rows, medians of "
          f"{args.reps - 2} runs: fused kernel {before:.3f} s, matmuls {after:.3f} s "
          f"({after / before:.3f})")


if __name__ == "__main__":
    main()
