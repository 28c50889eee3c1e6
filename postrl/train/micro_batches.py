"""How a minibatch's rows are cut into micro-batches: by rows, and optionally by tokens.

A micro-batch's activations grow with its tokens, not its rows: 8 responses of 1,024 tokens
hold about 16 times the activations of 8 of 64. A token budget (``micro_batch_tokens``, as
verl's ``ppo_max_token_len_per_gpu`` with dynamic batch sizes) keeps the update's peak memory
bounded whatever the response length, and the minibatch's loss is normalised by its global
counts, so the cut changes no gradient (up to the order of float sums).
"""

from __future__ import annotations

from torch import Tensor

from postrl.train.batch import TrainBatch


def micro_batches(rows: Tensor, batch: TrainBatch, max_rows: int, max_tokens: int = 0,
                  share_prompts: bool = True) -> list[Tensor]:
    """Consecutive slices of ``rows`` (kept in their order) of at most ``max_rows`` rows and,
    when ``max_tokens`` > 0, at most ``max_tokens`` tokens: every response's attended tokens
    and each prompt once per micro-batch (``share_prompts``: rows of a prompt share its
    forward) or once per row. A row over the budget on its own runs alone."""
    responses = batch.response_mask.sum(dim=1)
    slices: list[Tensor] = []
    start, tokens, prompts = 0, 0, set()
    for position, row in enumerate(rows.tolist()):
        prompt = tuple(batch.prompt_ids[row]) if share_prompts else row
        cost = int(responses[row]) + (0 if prompt in prompts else len(batch.prompt_ids[row]))
        full = position - start == max_rows or (max_tokens and tokens + cost > max_tokens)
        if full and position > start:
            slices.append(rows[start:position])
            start, tokens, prompts = position, 0, set()
            cost = int(responses[row]) + len(batch.prompt_ids[row])
        tokens += cost
        prompts.add(prompt)
    if len(rows) > start:
        slices.append(rows[start:])
    return slices
